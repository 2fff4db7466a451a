"""Triton paged decode attention: one query token per sequence over its paged KV context.

GPU path of `paged_decode_attention` in engine/model/attention.py (decode steps); the pure-torch
oracle with the same arguments is `kernels.reference.paged_decode_attention`.
Cache layout: k_cache, v_cache [num_pages, page_size, num_kv_heads, head_dim]; token t of
sequence b lives in page `page_table[b, t // page_size]` at offset `t % page_size`.

One program per (sequence, kv head) handles every query head of that GQA group at once, so each
key/value block is loaded once per group. It walks the context in BLOCK_N-token blocks with an
online softmax (running max / running sum), so memory use does not grow with context length.
That key-block loop (`attend_paged_context`) and the host-side argument checks are shared with
the prefill kernel in `kernels.triton_paged_common`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.triton_paged_common import (
    attend_paged_context,
    check_index_dtypes,
    check_page_table,
    check_query_and_cache,
    check_same_device,
)

_BLOCK_N = 32  # context tokens per inner-loop step (>= 16 for tl.dot)


@triton.jit
def _decode_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_table_ptr,  # [num_seqs, max_pages]
    context_lens_ptr,  # [num_seqs]
    out_ptr,  # [num_seqs, num_heads, head_dim]
    qk_scale,  # softmax scale * log2(e): scores go through exp2
    group_size, head_dim, page_size,
    stride_qs, stride_qh, stride_qd,
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_vp, stride_vs, stride_vh, stride_vd,
    stride_pts, stride_ptp,
    stride_os, stride_oh, stride_od,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    ctx_len = tl.load(context_lens_ptr + seq)

    g = tl.arange(0, BLOCK_G)  # [BLOCK_G] query heads of this group (padded)
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D] (padded head_dim)
    heads = kv_head * group_size + g
    g_mask = g < group_size
    d_mask = d < head_dim
    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )  # [BLOCK_G, BLOCK_D]

    out = attend_paged_context(
        q, None, ctx_len, ctx_len, qk_scale,  # one query token: no causal mask needed
        k_cache_ptr + kv_head * stride_kh, v_cache_ptr + kv_head * stride_vh,
        page_table_ptr + seq * stride_pts, d, d_mask, page_size, stride_ptp,
        stride_kp, stride_ks, stride_kd, stride_vp, stride_vs, stride_vd,
        ROWS=BLOCK_G, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, INPUT_PRECISION=INPUT_PRECISION,
    )  # [BLOCK_G, BLOCK_D] float32
    tl.store(
        out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=g_mask[:, None] & d_mask[None, :],
    )


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [num_seqs, max_pages] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, includes the query token
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One query token per sequence, attending to its first `context_lens[i]` cached tokens."""
    check_query_and_cache(query, k_cache, v_cache, "num_seqs")
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    check_page_table(page_table, num_seqs)
    if context_lens.shape != (num_seqs,):
        raise ValueError(f"context_lens must be [{num_seqs}]; got {tuple(context_lens.shape)}")
    check_index_dtypes(page_table=page_table, context_lens=context_lens)
    check_same_device(query, k_cache, v_cache, page_table, context_lens)

    out = torch.empty_like(query)
    if num_seqs == 0 or num_heads == 0:
        return out
    group_size = num_heads // num_kv_heads
    _decode_kernel[(num_seqs, num_kv_heads)](
        query, k_cache, v_cache, page_table, context_lens, out,
        float(scale) * math.log2(math.e),
        group_size, head_dim, k_cache.shape[1],
        *query.stride(), *k_cache.stride(), *v_cache.stride(), *page_table.stride(), *out.stride(),
        BLOCK_G=max(16, triton.next_power_of_2(group_size)),  # tl.dot needs >= 16 rows
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=_BLOCK_N,
        INPUT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    return out
