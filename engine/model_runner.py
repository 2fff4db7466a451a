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
        """Packs decodes (one query token) first, then prefill chunks; also returns the sequences
        that sample this step, in the order of `logits_indices`. A speculating decode (its last
        token and k proposed ones) is packed as 1 + k decodes of one token each over the same
        pages, token j seeing the context through itself: the step stores all their K/V before
        attending, so each row is computed exactly as plain decoding would compute it (same
        kernel, same rounding in bf16: greedy speculation stays token-identical), and it needs
        all 1 + k rows of logits. Python touches each sequence once (its token slice, page table
        and counts); per-token metadata (positions, KV slots) comes from a few tensor ops over
        those, not per-token Python lists."""
        # Attention entries, each (sequence, tokens computed before it, its query tokens, samples?)
        decodes: list[tuple[ScheduledSeq, int, list[int], bool]] = []
        prefills: list[tuple[ScheduledSeq, int, list[int], bool]] = []
        for s in scheduled:
            start, n = s.seq.num_computed_tokens, s.num_new_tokens
            if s.draft is not None:  # not part of the sequence unless accepted
                tokens = s.seq.token_ids[start:start + n - len(s.draft)] + list(s.draft.token_ids)
                decodes += [(s, start + j, [token], True) for j, token in enumerate(tokens)]
            else:
                (decodes if n == 1 else prefills).append((s, start, s.seq.token_ids[start:start + n], s.samples))
        entries = decodes + prefills
        num_new = [len(tokens) for _, _, tokens, _ in entries]
        computed = [start for _, start, _, _ in entries]
        input_ids = [token for _, _, tokens, _ in entries for token in tokens]
        max_pages = max(len(s.seq.page_table) for s, _, _, _ in entries)
        page_table = torch.tensor([s.seq.page_table + [0] * (max_pages - len(s.seq.page_table))
                                   for s, _, _, _ in entries], dtype=torch.int32)
        q_lens = torch.tensor(num_new, dtype=torch.int64)
        ends = torch.tensor(computed, dtype=torch.int64) + q_lens  # context length of each entry
        starts = torch.zeros(len(entries) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=starts[1:])
        if len(input_ids) == len(entries):  # decodes only: one token per entry
            rows = torch.arange(len(entries))
            positions = ends - 1
        else:
            rows = torch.repeat_interleave(torch.arange(len(entries)), q_lens)
            positions = torch.arange(len(input_ids)) - starts[rows] + (ends - q_lens)[rows]
        page_size = self.page_size
        slots = page_table[rows, positions // page_size].to(torch.int64) * page_size + positions % page_size
        # A speculating sequence's entries are adjacent: it joins `sampled` once, at its first.
        sampled = [s for i, (s, _, _, samples) in enumerate(entries)
                   if samples and (s.draft is None or i == 0 or entries[i - 1][0] is not s)]
        logits_indices = starts[1:][torch.tensor([samples for _, _, _, samples in entries], dtype=torch.bool)] - 1
        dev = self.device
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=positions.to(dev),
            slot_mapping=slots.to(dev),
            page_table=page_table.to(dev),
            query_start_loc=starts.to(torch.int32).to(dev),
            context_lens=ends.to(torch.int32).to(dev),
            num_decode_seqs=len(decodes),
            logits_indices=logits_indices.to(dev),
        ), sampled

    def execute(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """Runs one step; returns logits [rows, vocab] (float32, on CPU) and the sequences they
        belong to, in row order: one row each, 1 + k for a sequence verifying k proposed tokens."""
        hidden, sampled = self.execute_hidden(scheduled)
        return self.logits(hidden), sampled

    def execute_hidden(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, list[ScheduledSeq]]:
        """`execute` stopped before the vocabulary projection: the final-norm hidden states
        [rows, hidden] of the same rows (what Medusa heads read), on the model's device."""
        batch, sampled = self.build_batch(scheduled)
        return self.executor.run(batch), sampled

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> [rows, vocab] float32 on CPU."""
        if not hidden.shape[0]:
            return torch.empty(0, self.model.cfg.vocab_size)
        return self.model.compute_logits(hidden).cpu()
