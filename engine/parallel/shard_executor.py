"""Runs one model step, and moves KV pages, across the ranks of a TP x PP worker.

The model runner (engine/model_runner.py) hands a ForwardBatch to an executor and gets back
the final hidden states of the rows to sample. `LocalExecutor` is the single-process case.
`GroupDriver` (rank 0) broadcasts each command to the follower ranks, which run
`follower_loop` (engine/parallel/shard_follower.py starts them):

    STEP   header + the batch's integer arrays      -> every stage runs its layers; stage
                                                       k sends hidden states to stage k+1 (same
                                                       tp rank); the last stage returns the
                                                       sampled rows to the driver
    READ   page ids  -> every rank sends its [2, layers, n, page, heads, d] slice to the driver
    WRITE  page ids  -> the driver sends every rank its slice of the pages
    NOOP             -> nothing (the driver's keep-alive while idle, so the followers'
                        wait for a command stays inside the group's timeout)
    STOP             -> followers leave the loop

Commands are plain int64 tensors on the group (no pickle), issued under one lock, so every
rank sees the same sequence of collectives.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch

from engine.forward_batch import ForwardBatch
from engine.kv_cache import KVCache
from engine.model.llama import LlamaForCausalLM
from engine.parallel.layout import ShardGroup

OP_STEP, OP_READ, OP_WRITE, OP_STOP, OP_NOOP = 1, 2, 3, 4, 5
HEADER_LEN = 6  # [op, num_tokens, num_seqs, max_pages, num_decode_seqs, num_sampled] or [op, num_pages, 0...]


class LocalExecutor:
    """The whole model in this process."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache) -> None:
        self.model, self.kv_cache = model, kv_cache

    def run(self, batch: ForwardBatch) -> torch.Tensor:  # [num_sampled, hidden]
        return self.model(batch, self.kv_cache)

    def close(self) -> None:
        pass


# -- the step command's wire form ------------------------------------------------------------
def encode_batch(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    num_seqs, max_pages = batch.page_table.shape
    header = torch.tensor([OP_STEP, batch.num_tokens, num_seqs, max_pages, batch.num_decode_seqs,
                           batch.logits_indices.shape[0]], dtype=torch.int64)
    body = torch.cat([batch.input_ids, batch.positions, batch.slot_mapping, batch.page_table.flatten().long(),
                      batch.query_start_loc.long(), batch.context_lens.long(), batch.logits_indices]).cpu()
    return header, body


def body_len(header: torch.Tensor) -> int:
    _, num_tokens, num_seqs, max_pages, _, num_sampled = header.tolist()
    return 3 * num_tokens + num_seqs * max_pages + (num_seqs + 1) + num_seqs + num_sampled


def decode_batch(header: torch.Tensor, body: torch.Tensor, device: torch.device | str) -> ForwardBatch:
    _, num_tokens, num_seqs, max_pages, num_decode, num_sampled = header.tolist()
    sizes = [num_tokens, num_tokens, num_tokens, num_seqs * max_pages, num_seqs + 1, num_seqs, num_sampled]
    ids, pos, slots, table, starts, lens, logits = body.to(device).split(sizes)
    return ForwardBatch(
        input_ids=ids, positions=pos, slot_mapping=slots,
        page_table=table.view(num_seqs, max_pages).int(), query_start_loc=starts.int(),
        context_lens=lens.int(), num_decode_seqs=num_decode, logits_indices=logits,
    )


def run_stage(group: ShardGroup, model: LlamaForCausalLM, kv_cache: KVCache, batch: ForwardBatch
              ) -> torch.Tensor | None:
    """This rank's part of a step. Returns the hidden states of the sampled rows on the last
    stage's tp-rank 0 (None elsewhere), before the final norm."""
    layout = group.layout
    hidden = None
    if not layout.is_first_stage:
        hidden = torch.empty(batch.num_tokens, model.cfg.hidden_size, dtype=model.embed_tokens.weight.dtype,
                             device=group.device)
        group.recv(hidden, layout.rank_of(layout.pp_rank - 1, layout.tp_rank))
    hidden = model.forward_stage(batch, kv_cache, hidden)
    if not layout.is_last_stage:
        group.send(hidden.contiguous(), layout.rank_of(layout.pp_rank + 1, layout.tp_rank))
        return None
    return hidden[batch.logits_indices] if layout.tp_rank == 0 else None


class GroupDriver:
    """Rank 0's executor: issues every command, runs its own stage, collects the result."""

    def __init__(self, group: ShardGroup, model: LlamaForCausalLM, kv_cache: KVCache) -> None:
        self.group, self.model, self.kv_cache = group, model, kv_cache
        self._lock = threading.Lock()  # one command (with its data) at a time, in order
        self._last_command = time.monotonic()
        self._closed = threading.Event()
        self._keepalive = threading.Thread(target=self._keep_alive, name="pdserve-shard-keepalive", daemon=True)
        self._keepalive.start()

    def run(self, batch: ForwardBatch) -> torch.Tensor:  # [num_sampled, hidden]
        header, body = encode_batch(batch)
        layout = self.group.layout
        num_sampled = batch.logits_indices.shape[0]
        with self._command(header):
            self.group.broadcast(body.to(self.group.device))
            rows = run_stage(self.group, self.model, self.kv_cache, batch)
            if not layout.is_last_stage and num_sampled:
                rows = torch.empty(num_sampled, self.model.cfg.hidden_size,
                                   dtype=self.model.embed_tokens.weight.dtype, device=self.group.device)
                self.group.recv(rows, layout.rank_of(layout.pp_size - 1, 0))
        if rows is None:
            rows = torch.empty(0, self.model.cfg.hidden_size, dtype=self.model.embed_tokens.weight.dtype)
        return self.model.norm.normed(rows, self.model.backend.fused_ops)

    @contextmanager
    def pages_command(self, op: int, page_ids: list[int]):
        """READ or WRITE: the caller moves the page data inside the block."""
        with self._command(_header(op, len(page_ids))):
            self.group.broadcast(torch.tensor(page_ids, dtype=torch.int64, device=self.group.device))
            yield

    @contextmanager
    def _command(self, header: torch.Tensor):
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError("the shard group is closed")
            self.group.broadcast(header.to(self.group.device))
            yield
            self._last_command = time.monotonic()

    def _keep_alive(self) -> None:
        period = self.group.timeout_s / 4
        while not self._closed.wait(period / 4):
            if time.monotonic() - self._last_command > period:
                try:
                    with self._command(_header(OP_NOOP)):
                        pass
                except RuntimeError:  # closed meanwhile, or the group is gone
                    return

    def close(self) -> None:
        """Sends STOP once; followers then leave their loop."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            self.group.broadcast(_header(OP_STOP).to(self.group.device))


def _header(op: int, num_pages: int = 0) -> torch.Tensor:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0], header[1] = op, num_pages
    return header


def follower_loop(group: ShardGroup, model: LlamaForCausalLM, kv_cache: KVCache) -> None:
    """A follower rank's whole life: execute the driver's commands until STOP."""
    device = group.device
    while True:
        header = group.broadcast(torch.empty(HEADER_LEN, dtype=torch.int64, device=device)).cpu()
        op = int(header[0])
        if op == OP_STOP:
            return
        if op == OP_NOOP:
            continue
        if op == OP_STEP:
            body = group.broadcast(torch.empty(body_len(header), dtype=torch.int64, device=device))
            batch = decode_batch(header, body, kv_cache.device)
            rows = run_stage(group, model, kv_cache, batch)
            if rows is not None and rows.shape[0]:
                group.send(rows.contiguous(), 0)
            continue
        page_ids = group.broadcast(torch.empty(int(header[1]), dtype=torch.int64, device=device)).tolist()
        if op == OP_READ:
            group.send(kv_cache.read_pages(page_ids), 0)
        elif op == OP_WRITE:
            data = torch.empty(kv_cache.pages_shape(len(page_ids)), dtype=kv_cache.dtype, device=device)
            kv_cache.write_pages(page_ids, group.recv(data, 0))
        else:
            raise RuntimeError(f"unknown shard command {op}")
