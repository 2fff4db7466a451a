"""Triton paged decode attention: one query token per sequence over its paged KV context.

GPU path of `paged_decode_attention` in engine/attention.py (decode steps); the pure-torch
oracle with the same arguments is `kernels.reference.paged_decode_attention`.
Cache layout: k_cache, v_cache [num_pages, page_size, num_kv_heads, head_dim]; token t of
sequence b lives in page `page_table[b, t // page_size]` at offset `t % page_size`.

One program per (sequence, kv head) handles every query head of that GQA group at once, so each
key/value block is loaded once per group. It walks the context in BLOCK_N-token blocks with an
online softmax (running max / running sum), so memory use does not grow with context length.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

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

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(0, ctx_len, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] token positions
        n_mask = n < ctx_len
        page = tl.load(
            page_table_ptr + seq * stride_pts + (n // page_size) * stride_ptp, mask=n_mask, other=0
        ).to(tl.int64)
        in_page = (n % page_size).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_cache_ptr + page[:, None] * stride_kp + in_page[:, None] * stride_ks
            + kv_head * stride_kh + d[None, :] * stride_kd,
            mask=kv_mask, other=0.0,
        ).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        v = tl.load(
            v_cache_ptr + page[:, None] * stride_vp + in_page[:, None] * stride_vs
            + kv_head * stride_vh + d[None, :] * stride_vd,
            mask=kv_mask, other=0.0,
        ).to(q.dtype)  # [BLOCK_N, BLOCK_D]

        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # empty context -> zeros, not NaN
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
    if query.dim() != 3:
        raise ValueError(f"query must be [num_seqs, num_heads, head_dim]; got {tuple(query.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must both be [num_pages, page_size, num_kv_heads, head_dim]; "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {k_cache.shape[3]} != query head_dim {head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if page_table.dim() != 2 or page_table.shape[0] != num_seqs:
        raise ValueError(
            f"page_table must be [{num_seqs}, max_pages]; got {tuple(page_table.shape)}"
        )
    if context_lens.shape != (num_seqs,):
        raise ValueError(f"context_lens must be [{num_seqs}]; got {tuple(context_lens.shape)}")
    for name, t in (("page_table", page_table), ("context_lens", context_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64; got {t.dtype}")
    devices = {t.device for t in (query, k_cache, v_cache, page_table, context_lens)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")

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
