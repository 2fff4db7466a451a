"""Builds one rank's share of a model: its weights (heads and layers) and its KV cache.

Called by the engine (rank 0 of a worker, or the only rank) and by each follower rank of a
tensor/pipeline-parallel worker (engine/parallel/shard_follower.py). Every rank computes the same page
count from the same config, so page ids chosen by the driver mean the same slots everywhere.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from configs.engine import EngineConfig
from engine.kv_cache import KVCache
from engine.model.attention import AttentionBackend
from engine.model.compute_dtype import resolve_dtype
from engine.model.config import ModelConfig
from engine.model.layers import ParallelContext
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import load_model
from engine.parallel.layout import ShardGroup, ShardLayout
from kernels import cpu_ops

log = logging.getLogger(__name__)


@dataclass
class ModelShard:
    model: LlamaForCausalLM
    kv_cache: KVCache  # this rank's heads and layers
    num_pages: int


def attention_backend(config: EngineConfig, head_dim: int) -> AttentionBackend:
    """`auto`: the Triton kernels on GPU; on CPU the compiled kernel, or the torch ops (with a
    warning saying why) where it cannot be built or has no build for this head size."""
    name = config.attention_backend
    if name == "cpu" and head_dim not in cpu_ops.HEAD_DIMS:
        raise ValueError(f"attention_backend 'cpu' has no kernel for head_dim {head_dim} "
                         f"(built for {cpu_ops.HEAD_DIMS}); use 'auto' or 'torch'")
    if name == "auto":
        if config.device.startswith("cuda"):
            name = "triton"
        elif head_dim not in cpu_ops.HEAD_DIMS:
            log.info("head_dim %d has no compiled CPU kernel; attention runs on the torch path", head_dim)
            name = "torch"
        elif cpu_ops.load() is not None:
            name = "cpu"
        else:
            log.warning("the compiled CPU attention kernel is unavailable, serving on the slower torch "
                        "path: %s", cpu_ops.load_error())
            name = "torch"
    return AttentionBackend(name)


def num_pages_for(config: EngineConfig, cfg: ModelConfig, layout: ShardLayout) -> int:
    if config.num_pages is not None:
        return config.num_pages
    page_bytes = layout.page_bytes(cfg, config.page_size, resolve_dtype(config.dtype, config.device))
    num_pages = config.kv_cache_memory_bytes // page_bytes
    if num_pages < 1:
        raise ValueError(f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} holds no page: one page of "
                         f"{config.page_size} tokens needs {page_bytes} bytes")
    return int(num_pages)


def load_shard(config: EngineConfig, model_path: Path, layout: ShardLayout, group: ShardGroup | None) -> ModelShard:
    cfg = ModelConfig.from_dir(model_path)
    layout.check_model(cfg)
    layers = layout.stage_layers(cfg.num_layers)
    ctx = ParallelContext(layout.tp_rank, layout.tp_size, group)
    dtype = resolve_dtype(config.dtype, config.device)
    model = load_model(model_path, dtype, config.device, attention_backend(config, cfg.head_dim), ctx, layers)
    num_pages = num_pages_for(config, cfg, layout)
    kv_cache = KVCache(cfg, num_pages, config.page_size, dtype, config.device,
                       num_kv_heads=cfg.num_kv_heads // layout.tp_size, layers=layers)
    return ModelShard(model, kv_cache, num_pages)
