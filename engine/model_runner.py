"""Turns a scheduler decision into a ForwardBatch, runs the model, returns the logits to sample.

Sits between the engine's step loop (engine/engine.py) and the model: an executor
(engine/parallel/shard_executor.py) runs the batch on this process or across a TP x PP group; the
runner knows nothing about request lifecycles.
"""

from __future__ import annotations

import torch

from engine.forward_batch import ForwardBatch
from engine.model.llama import LlamaForCausalLM
from engine.parallel.shard_executor import GroupDriver, LocalExecutor
from engine.scheduler import ScheduledSeq


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, executor: LocalExecutor | GroupDriver, page_size: int,
                 device: torch.device | str) -> None:
        self.model = model
        self.executor = executor
        self.page_size = page_size
        self.device = torch.device(device)

    def build_batch(self, scheduled: list[ScheduledSeq]) -> tuple[ForwardBatch, list[ScheduledSeq]]:
        """Packs decodes (one query token) first, then prefill chunks and speculating decodes
        (their last token + proposed ones, a chunk over cached context); also returns the
        sequences that sample this step, in the order of `logits_indices`. Python touches each
        sequence once (its token slice, page table and counts); per-token metadata (positions,
        KV slots) comes from a few tensor ops over those, not per-token Python lists."""
        ordered = [s for s in scheduled if s.num_new_tokens == 1] + [s for s in scheduled if s.num_new_tokens > 1]
        num_new = [s.num_new_tokens for s in ordered]
        computed = [s.seq.num_computed_tokens for s in ordered]
        input_ids: list[int] = []
        for s, start, n in zip(ordered, computed, num_new):
            if s.draft is None:
                input_ids += s.seq.token_ids[start:start + n]
            else:  # its last token, then the proposed ones (not part of the sequence unless accepted)
                input_ids += s.seq.token_ids[start:start + n - len(s.draft)]
                input_ids += s.draft.token_ids
        max_pages = max(len(s.seq.page_table) for s in ordered)
        page_table = torch.tensor([s.seq.page_table + [0] * (max_pages - len(s.seq.page_table)) for s in ordered],
                                  dtype=torch.int32)
        q_lens = torch.tensor(num_new, dtype=torch.int64)
        ends = torch.tensor(computed, dtype=torch.int64) + q_lens  # context length of each sequence
        starts = torch.zeros(len(ordered) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=starts[1:])
        if len(input_ids) == len(ordered):  # decodes only: one token per sequence
            rows = torch.arange(len(ordered))
            positions = ends - 1
        else:
            rows = torch.repeat_interleave(torch.arange(len(ordered)), q_lens)
            positions = torch.arange(len(input_ids)) - starts[rows] + (ends - q_lens)[rows]
        page_size = self.page_size
        slots = page_table[rows, positions // page_size].to(torch.int64) * page_size + positions % page_size
        sampled = [s for s in ordered if s.samples]
        logits_indices = starts[1:][torch.tensor([s.samples for s in ordered], dtype=torch.bool)] - 1
        if any(s.draft is not None for s in sampled):
            # A speculating sequence needs the logits of its last 1 + k rows (verification).
            rows_each = torch.tensor([1 + s.num_draft_tokens for s in sampled])
            first = torch.repeat_interleave(logits_indices + 1 - rows_each, rows_each)
            offset = torch.arange(int(rows_each.sum())) - torch.repeat_interleave(torch.cumsum(rows_each, 0) - rows_each,
                                                                                  rows_each)
            logits_indices = first + offset
        dev = self.device
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=positions.to(dev),
            slot_mapping=slots.to(dev),
            page_table=page_table.to(dev),
            query_start_loc=starts.to(torch.int32).to(dev),
            context_lens=ends.to(torch.int32).to(dev),
            num_decode_seqs=sum(1 for n in num_new if n == 1),
            logits_indices=logits_indices.to(dev),
        ), sampled

    def execute(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """Runs one step; returns logits [rows, vocab] (float32, on CPU) and the sequences they
        belong to, in row order: one row each, 1 + k for a sequence verifying k proposed tokens."""
        batch, sampled = self.build_batch(scheduled)
        hidden = self.executor.run(batch)
        if not sampled:
            return torch.empty(0, self.model.cfg.vocab_size), sampled
        return self.model.compute_logits(hidden).cpu(), sampled
