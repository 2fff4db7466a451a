"""The draft's follow-up decode steps as tensors: after its catch-up step, a draft model
(engine/spec/draft_proposer.py) feeds each guess back for k - 1 more one-token steps. Every such
step's batch differs from the previous one only by one position per row (pages for all k - 1
guesses were allocated before the catch-up), so it is derived from the previous one with a few
tensor ops instead of rebuilt from the sequences by the model runner (engine/model_runner.py's
build_batch walks Python lists per sequence: a fifth of a draft step's time at concurrency 1).

The batch is exactly what build_batch would make for the same one-token decodes: same slots,
positions and context lengths, so the draft's guesses (and its KV) are unchanged.
"""

from __future__ import annotations

import torch

from engine.forward_batch import ForwardBatch
from engine.sequence import Sequence


def first_decode_batch(seqs: list[Sequence], page_size: int, device: torch.device) -> ForwardBatch:
    """One-token decodes of each sequence's last token (its KV not yet computed), pages already held."""
    return _decode_batch(*decode_inputs(seqs), page_size, device)


def decode_inputs(seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, positions, page_table) of first_decode_batch's decodes: each sequence's first
    token without KV, its position, and its pages padded to the longest row."""
    max_pages = max(len(seq.page_table) for seq in seqs)
    page_table = torch.tensor([seq.page_table + [0] * (max_pages - len(seq.page_table)) for seq in seqs],
                              dtype=torch.int32)  # [num_seqs, max_pages]
    positions = torch.tensor([seq.num_computed_tokens for seq in seqs], dtype=torch.int64)  # [num_seqs]
    input_ids = torch.tensor([seq.token_ids[seq.num_computed_tokens] for seq in seqs], dtype=torch.int64)
    return input_ids, positions, page_table


def next_decode_batch(prev: ForwardBatch, input_ids: torch.Tensor, keep: torch.Tensor | None,
                      page_size: int) -> ForwardBatch:
    """The step after `prev` (a batch of one-token decodes): the rows `keep` (all when None) each
    feed `input_ids` [len(keep)] at the position after the previous one."""
    positions, page_table = prev.positions, prev.page_table
    if keep is not None:
        positions, page_table = positions[keep], page_table[keep]
    return _decode_batch(input_ids.to(torch.int64), positions + 1, page_table, page_size, prev.positions.device)


def _decode_batch(input_ids: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor, page_size: int,
                  device: torch.device) -> ForwardBatch:
    num_seqs = positions.shape[0]
    rows = torch.arange(num_seqs)
    table = page_table.cpu()
    pos = positions.cpu()
    slots = table[rows, pos // page_size].to(torch.int64) * page_size + pos % page_size
    return ForwardBatch(
        input_ids=input_ids.to(device),
        positions=positions.to(device),
        slot_mapping=slots.to(device),
        page_table=page_table.to(device),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=device),
        context_lens=(positions + 1).to(torch.int32).to(device),
        num_decode_seqs=num_seqs,
        logits_indices=torch.arange(num_seqs, dtype=torch.int64, device=device),
    )
