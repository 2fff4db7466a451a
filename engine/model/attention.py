"""Paged attention for one layer: store this step's K/V into the cache, then attend over it.

Called by each decoder layer of engine/model/llama.py with the step's ForwardBatch. The
backend is chosen once per engine: `cpu` (the compiled kernels/cpu_ops.py: the whole mixed
batch in one call that reads pages in place; the CPU serving path), `torch` (kernels/reference.py:
the oracle, and the CPU fallback where no compiler is at hand) or `triton` (the kernels/ Triton
kernels, the GPU path). All take identical arguments.

The compiled kernel multiplies bf16 prefill tiles as small matrix products: on AMX tiles where
the CPU has them (kernels/cpu/prefill_tile_amx.h), else with AVX512-BF16
(kernels/cpu/prefill_tile_bf16.h; 1.4-1.5 ms for a 512-token prompt a layer on 2 Zen 5 cores,
where SDPA took 7). On AMX, against torch's flash SDPA (whose products also run on AMX tiles),
bf16, 12 query / 4 KV heads of 64, 2 cores, a layer: a 512-token prompt 0.90 vs 1.34 ms, 128
tokens over 1,152 cached 0.82 vs 1.33 (with SDPA's page gather), 2,048 tokens 11.0 vs 13.3.
One exception to "one call" remains: an AMX CPU whose build or OS refuses the tiles sends bf16
prefill chunks to SDPA (kernels/reference.py), which still reaches AMX through oneDNN; the
compiled kernel keeps the decodes.
"""

from __future__ import annotations

from types import ModuleType

import torch

from engine.forward_batch import ForwardBatch
from kernels import packed_linear, reference


class AttentionBackend:
    """The cache ops, taken from one implementation module each. `mixed_attention`, where set,
    attends decodes and prefill chunks of one step in a single call; `skinny_linear`, where
    set, is the model's x W^T for few-row activations (engine/model/layers.py `linear`);
    `packs_linears`, where true, has the model multiply by weights packed once for oneDNN;
    `fused_ops`, where set, fuses the norms, rotary and SiLU-mul of each layer."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.mixed_attention = None
        self.skinny_linear = None
        self.fused_ops: ModuleType | None = None  # fused norm / rotary / SiLU-mul (kernels.cpu_ops)
        self.packs_linears = False  # the model packs its linear weights for oneDNN (kernels/packed_linear.py)
        if name == "cpu":
            from kernels import cpu_ops

            if cpu_ops.load() is None:
                raise RuntimeError(f"attention_backend 'cpu' is unavailable: {cpu_ops.load_error()}")
            store, decode, prefill = cpu_ops, cpu_ops, reference
            self.mixed_attention = cpu_ops.paged_attention
            self.skinny_linear = cpu_ops.skinny_linear
            self.fused_ops = cpu_ops
            self.packs_linears = packed_linear.available()
        elif name == "torch":
            store: ModuleType = reference
            decode: ModuleType = reference
            prefill: ModuleType = reference
        elif name == "triton":
            from kernels import triton_decode_attention as decode
            from kernels import triton_prefill_attention as prefill
            from kernels import triton_store_kv as store
        else:
            raise ValueError(f"unknown attention backend {name!r}; choose 'cpu', 'torch' or 'triton'")
        self.store_kv = store.store_kv
        self.paged_decode_attention = decode.paged_decode_attention
        self.paged_prefill_attention = prefill.paged_prefill_attention
        # Compute dtypes whose prefill chunks go to torch's SDPA (`paged_prefill_attention` of
        # kernels/reference.py) rather than to `mixed_attention`: every dtype on the torch path;
        # on the cpu path bf16 where AMX multiplies it (the module docstring has the figures).
        # The Triton kernels read pages at full speed themselves.
        self.sdpa_prefill_dtypes: tuple[torch.dtype, ...] = ()
        if name == "torch":
            self.sdpa_prefill_dtypes = (torch.float32, torch.bfloat16, torch.float16)
        elif name == "cpu" and torch.cpu._is_amx_tile_supported() and not cpu_ops.amx_attention_supported():
            self.sdpa_prefill_dtypes = (torch.bfloat16,)


def paged_attention(
    backend: AttentionBackend,
    batch: ForwardBatch,
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    backend.store_kv(key, value, k_cache, v_cache, batch.slot_mapping)
    num_decode = batch.num_decode_seqs
    num_seqs = batch.num_seqs
    sdpa_prefill = query.dtype in backend.sdpa_prefill_dtypes
    if sdpa_prefill and _is_fresh_single_prompt(batch):  # its K/V are in hand: no reading them back from pages
        return reference.fresh_prompt_attention(query, key, value, scale)
    if backend.mixed_attention is not None and (not sdpa_prefill or num_decode == num_seqs):
        return backend.mixed_attention(query, k_cache, v_cache, batch.page_table, batch.query_start_loc,
                                       batch.context_lens, scale)
    if num_decode == num_seqs:
        return backend.paged_decode_attention(
            query, k_cache, v_cache, batch.page_table, batch.context_lens, scale
        )
    out = torch.empty_like(query)
    if num_decode:
        out[:num_decode] = backend.paged_decode_attention(
            query[:num_decode], k_cache, v_cache, batch.page_table[:num_decode],
            batch.context_lens[:num_decode], scale,
        )
    starts = batch.query_start_loc[num_decode:]
    out[num_decode:] = backend.paged_prefill_attention(
        query[num_decode:], k_cache, v_cache, batch.page_table[num_decode:],
        starts - starts[0], batch.context_lens[num_decode:], scale,
    )
    return out


def _is_fresh_single_prompt(batch: ForwardBatch) -> bool:
    return batch.num_seqs == 1 and int(batch.context_lens[0]) == batch.num_tokens
