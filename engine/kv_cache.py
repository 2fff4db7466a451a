"""The paged KV cache: one K and one V page tensor per layer, sized from a memory budget.

Owned by the engine (one per worker process); the model's attention layers read and write it
through slot indices, the page manager (engine/page_manager.py) decides which pages belong to
which sequence. Pages are interchangeable, so the cache knows nothing about sequences.
"""

from __future__ import annotations

import torch

from engine import huge_pages
from engine.model.config import ModelConfig


class KVCache:
    def __init__(
        self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device | str,
        num_kv_heads: int | None = None, layers: range | None = None,
    ) -> None:
        """A tensor-parallel shard holds `num_kv_heads` of the heads, a pipeline stage only its
        `layers` (global ids); the default is the whole model."""
        self.num_pages = num_pages
        self.page_size = page_size
        self.layers = layers if layers is not None else range(cfg.num_layers)
        kv_heads = num_kv_heads or cfg.num_kv_heads
        shape = (num_pages, page_size, kv_heads, cfg.head_dim)  # per layer
        # Zeroed after the huge-page advice, so the zeroing's faults take huge pages.
        self.k = [huge_pages.empty(shape, dtype, device).zero_() for _ in self.layers]
        self.v = [huge_pages.empty(shape, dtype, device).zero_() for _ in self.layers]

    @staticmethod
    def pages_for_budget(cfg: ModelConfig, memory_bytes: int, page_size: int, dtype: torch.dtype) -> int:
        """How many pages fit in `memory_bytes` across all layers (K and V)."""
        bytes_per_page = cfg.kv_bytes_per_token(torch.finfo(dtype).bits // 8) * page_size
        num_pages = memory_bytes // bytes_per_page
        if num_pages < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={memory_bytes} holds no page: one page of {page_size} tokens "
                f"needs {bytes_per_page} bytes"
            )
        return int(num_pages)

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = layer_id - self.layers.start
        return self.k[i], self.v[i]

    def pages_shape(self, num_pages: int) -> tuple[int, ...]:
        """Shape of `read_pages` output for num_pages pages: [2, num_layers, n, page_size, kvh, d]."""
        return (2, len(self.k), num_pages, *self.k[0].shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def read_pages(self, page_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of these pages across all layers: [2 (k, v), num_layers, n, page_size, kvh, d],
        written into `out` when given (a reused buffer: no fresh memory to fault in)."""
        index = torch.tensor(page_ids, dtype=torch.int64, device=self.k[0].device)
        if out is None:
            out = self.k[0].new_empty(self.pages_shape(len(page_ids)))
        for side, tensors in enumerate((self.k, self.v)):
            for layer, t in enumerate(tensors):
                torch.index_select(t, 0, index, out=out[side, layer])  # one copy, straight into place
        return out

    def write_pages(self, page_ids: list[int], data: torch.Tensor) -> None:
        """Writes `read_pages` output (from another cache of the same geometry) into these pages."""
        expected = self.pages_shape(len(page_ids))
        if tuple(data.shape) != expected:
            raise ValueError(f"KV data has shape {tuple(data.shape)}, expected {expected}")
        index = torch.tensor(page_ids, dtype=torch.int64, device=self.k[0].device)
        for side, tensors in enumerate((self.k, self.v)):
            for layer, t in enumerate(tensors):
                t.index_copy_(0, index, data[side, layer].to(device=t.device, dtype=t.dtype))

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
