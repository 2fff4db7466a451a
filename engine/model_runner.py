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
        """Packs decodes (one query token) first, then prefill chunks; also returns the
        sequences that sample this step, in the order of `logits_indices`."""
        ordered = [s for s in scheduled if s.num_new_tokens == 1] + [s for s in scheduled if s.num_new_tokens > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        context_lens: list[int] = []
        logits_indices: list[int] = []
        page_size = self.page_size
        for s in ordered:
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            table = seq.page_table
            slots += [table[p // page_size] * page_size + p % page_size for p in range(start, end)]
            starts.append(starts[-1] + s.num_new_tokens)
            context_lens.append(end)
            if s.samples:
                logits_indices.append(starts[-1] - 1)
        max_pages = max(len(s.seq.page_table) for s in ordered)
        page_table = torch.zeros(len(ordered), max_pages, dtype=torch.int32)
        for row, s in enumerate(ordered):
            page_table[row, : len(s.seq.page_table)] = torch.tensor(s.seq.page_table, dtype=torch.int32)
        dev = self.device
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            page_table=page_table.to(dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            num_decode_seqs=sum(1 for s in ordered if s.num_new_tokens == 1),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=dev),
        ), [s for s in ordered if s.samples]

    def execute(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """Runs one step; returns logits [num_sampled, vocab] (float32, on CPU) and the
        sequences they belong to, in row order."""
        batch, sampled = self.build_batch(scheduled)
        hidden = self.executor.run(batch)
        if not sampled:
            return torch.empty(0, self.model.cfg.vocab_size), sampled
        return self.model.compute_logits(hidden).cpu(), sampled
