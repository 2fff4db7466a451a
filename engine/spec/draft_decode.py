"""The draft's decode steps as tensors: a draft model (engine/spec/draft_proposer.py) computes
the few tokens each twin has no KV for (its catch-up after a verification), then feeds each
guess back for k - 1 more one-token steps. The catch-up is packed as one-token decode entries
(a run of c tokens is c entries over the same pages, as a verification's rows are), the batch
kernels/cpu/greedy_steps.cpp builds too, so the compiled proposal and this Python one write the
same KV and guess the same. Every follow-up step's batch differs from the previous one only by
one position per row (pages for all k - 1 guesses were allocated before the catch-up), so it is
derived from the previous one with a few tensor ops instead of rebuilt from the sequences by
the model runner (engine/model_runner.py's build_batch walks Python lists per sequence: a fifth
of a draft step's time at concurrency 1).

The batch is what build_batch would make for the same one-token decodes: same slots,
positions and context lengths.
"""

from __future__ import annotations

import torch

from engine.forward_batch import ForwardBatch
from engine.sequence import Sequence


def catch_up_batch(seqs: list[Sequence], page_size: int, device: torch.device) -> ForwardBatch:
    """Each sequence's tokens without KV (its catch-up: one after most verifications, a few
    after a fully accepted run), as one-token decode entries over its pages (already held), each
    attending through itself as a verification's rows do; one logits row per sequence, its last."""
    input_ids, positions, num_fed, page_table = decode_inputs(seqs)
    entry_row = torch.repeat_interleave(torch.arange(len(seqs)), num_fed)
    ends = torch.cumsum(num_fed, 0)
    entry_pos = positions[entry_row] + torch.arange(len(input_ids)) - (ends - num_fed)[entry_row]
    return _decode_batch(input_ids, entry_pos, page_table[entry_row], page_size, device, logits_rows=ends - 1)


def decode_inputs(seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, positions, num_fed, page_table) of catch_up_batch's decodes, as
    kernels/cpu/greedy_steps.cpp takes them: every sequence's tokens without KV, one sequence
    after another; the position of each one's first; how many each has; its pages padded to
    the longest row."""
    max_pages = max(len(seq.page_table) for seq in seqs)
    page_table = torch.tensor([seq.page_table + [0] * (max_pages - len(seq.page_table)) for seq in seqs],
                              dtype=torch.int32)  # [num_seqs, max_pages]
    positions = torch.tensor([seq.num_computed_tokens for seq in seqs], dtype=torch.int64)  # [num_seqs]
    num_fed = torch.tensor([seq.num_tokens - seq.num_computed_tokens for seq in seqs], dtype=torch.int64)
    input_ids = torch.tensor([t for seq in seqs for t in seq.token_ids[seq.num_computed_tokens:]], dtype=torch.int64)
    return input_ids, positions, num_fed, page_table


def next_decode_batch(prev: ForwardBatch, input_ids: torch.Tensor, keep: torch.Tensor | None,
                      page_size: int) -> ForwardBatch:
    """The step after `prev` (a batch of one-token decodes): the rows `keep` (all when None) each
    feed `input_ids` [len(keep)] at the position after the previous one."""
    # The entry each row guessed from (its last catch-up entry; every entry after a one-token step).
    positions, page_table = prev.positions[prev.logits_indices], prev.page_table[prev.logits_indices]
    if keep is not None:
        positions, page_table = positions[keep], page_table[keep]
    return _decode_batch(input_ids.to(torch.int64), positions + 1, page_table, page_size, prev.positions.device)


def _decode_batch(input_ids: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor, page_size: int,
                  device: torch.device, logits_rows: torch.Tensor | None = None) -> ForwardBatch:
    """One-token decode entries; logits at `logits_rows` (None: every entry's)."""
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
        logits_indices=(rows if logits_rows is None else logits_rows).to(device),
    )
