"""The driver's view of a TP x PP worker's KV cache: whole pages, every layer, every head.

Each rank's KVCache holds only its heads (tensor parallel) and layers (pipeline parallel).
KV transfer (engine/kv_transfer/) speaks in whole pages, so on the driver this facade gathers
a page set from every rank on `read_pages` and scatters it on `write_pages`. That is also what
regroups KV heads between pools of different TP sizes: a prefill worker with TP=2 sends whole
pages, a decode worker with TP=1 (or 4) cuts them to its own shards.
"""

from __future__ import annotations

import torch

from engine.kv_cache import KVCache
from engine.model.config import ModelConfig
from engine.parallel.shard_executor import OP_READ, OP_WRITE, GroupDriver


class ShardedKVCache:
    def __init__(self, cfg: ModelConfig, driver: GroupDriver) -> None:
        self.cfg, self.driver = cfg, driver
        self.local: KVCache = driver.kv_cache
        self.num_pages, self.page_size = self.local.num_pages, self.local.page_size
        layout = driver.group.layout
        # Where each rank's slice sits in a whole page: (rank, layers, heads).
        self._slices = [(r, layout.stage_layers(cfg.num_layers, r // layout.tp_size),
                         layout.kv_heads(cfg.num_kv_heads, r % layout.tp_size)) for r in range(layout.world_size)]

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device

    def pages_shape(self, num_pages: int) -> tuple[int, ...]:
        return (2, self.cfg.num_layers, num_pages, self.page_size, self.cfg.num_kv_heads, self.cfg.head_dim)

    def read_pages(self, page_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty(self.pages_shape(len(page_ids)), dtype=self.dtype, device=self.device)
        with self.driver.pages_command(OP_READ, page_ids):
            for rank, layers, heads in self._slices:
                view = out[:, layers.start : layers.stop, :, :, heads]
                if rank == 0:
                    view.copy_(self.local.read_pages(page_ids))
                else:
                    part = torch.empty(view.shape, dtype=self.dtype, device=self.device)
                    view.copy_(self.driver.group.recv(part, rank))
        return out

    def write_pages(self, page_ids: list[int], data: torch.Tensor) -> None:
        expected = self.pages_shape(len(page_ids))
        if tuple(data.shape) != expected:
            raise ValueError(f"KV data has shape {tuple(data.shape)}, expected {expected}")
        with self.driver.pages_command(OP_WRITE, page_ids):
            for rank, layers, heads in self._slices:
                part = data[:, layers.start : layers.stop, :, :, heads].to(device=self.device, dtype=self.dtype)
                if rank == 0:
                    self.local.write_pages(page_ids, part)
                else:
                    self.driver.group.send(part.contiguous(), rank)

    @property
    def num_bytes(self) -> int:
        """This rank's bytes (each rank holds its own share)."""
        return self.local.num_bytes
