"""The explicit per-step batch: everything the model needs to run one step, and nothing global.

Built by engine/model_runner.py from the scheduler's decision, consumed by every attention
layer of the model. Sequences are packed back to back: first the ones with a single query
token (decodes), then the ones with a chunk of prompt (prefills), so attention can take the
decodes as one batched call and the prefills sequence by sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, absolute position of each token
    slot_mapping: torch.Tensor  # [num_tokens] int64, page_id * page_size + offset
    page_table: torch.Tensor  # [num_seqs, max_pages] int32, padded with 0
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, offsets into the packed tokens
    context_lens: torch.Tensor  # [num_seqs] int32, tokens in the cache after this step
    num_decode_seqs: int  # the first num_decode_seqs sequences have exactly one query token
    logits_indices: torch.Tensor  # [num_sampled] int64, rows whose logits the sampler needs

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])
