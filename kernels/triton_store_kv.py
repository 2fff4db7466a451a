"""Triton kernel that scatters new keys/values into the paged KV cache.

GPU path of `store_kv` in engine/model/attention.py: after the model computes each step's keys and
values, this writes them into their cache slots before attention reads the cache back.
Same arguments and semantics as `kernels.reference.store_kv` (the pure-torch oracle):
    k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim]
    slot = page_id * page_size + offset_in_page; a negative slot means "skip this token".
Its host-side argument checks are shared with the attention kernels (`kernels.triton_paged_common`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_paged_common import check_index_dtypes, check_kv_cache, check_same_device


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    slot_ptr,  # [num_tokens]
    num_kv_heads, head_dim, page_size,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcp, stride_kcs, stride_kch, stride_kcd,
    stride_vcp, stride_vcs, stride_vch, stride_vcd,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per token: copies a [num_kv_heads, head_dim] tile for K and for V.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    page = slot // page_size
    offset = slot % page_size
    h = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    # A skipped token (negative slot) gets zero valid heads, so nothing is read or written.
    valid_heads = tl.where(slot >= 0, num_kv_heads, 0)
    mask = (h < valid_heads) & (d < head_dim)

    k = tl.load(key_ptr + tok * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    k_dst = k_cache_ptr + page * stride_kcp + offset * stride_kcs + h * stride_kch + d * stride_kcd
    v_dst = v_cache_ptr + page * stride_vcp + offset * stride_vcs + h * stride_vch + d * stride_vcd
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64 (int32 also accepted)
) -> None:
    """Scatter each token's key/value into its slot of the paged cache (in place)."""
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"key/value must both be [num_tokens, num_kv_heads, head_dim]; "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    check_kv_cache(k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"cache heads/head_dim {tuple(k_cache.shape[2:])} do not match key "
            f"{(num_kv_heads, head_dim)}"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}]; got {tuple(slot_mapping.shape)}")
    check_index_dtypes(slot_mapping=slot_mapping)
    check_same_device(key, value, k_cache, v_cache, slot_mapping)
    if num_tokens == 0:
        return

    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        num_kv_heads, head_dim, k_cache.shape[1],
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
