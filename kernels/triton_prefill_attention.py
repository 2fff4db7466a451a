"""Triton paged prefill attention: causal attention for packed variable-length query chunks.

GPU path of `paged_prefill_attention` in engine/attention.py (prefill and chunked prefill); the
pure-torch oracle with the same arguments is `kernels.reference.paged_prefill_attention`.
Cache layout: k_cache, v_cache [num_pages, page_size, num_kv_heads, head_dim]; token t of
sequence b lives in page `page_table[b, t // page_size]` at offset `t % page_size`. The chunk's
own keys/values must already be in the cache (store_kv runs first).

Query token i of sequence b (q_len_b tokens) sits at position `context_lens[b] - q_len_b + i` and
sees keys 0..that position. FlashAttention-style: one program per (query block, head, sequence)
walks key blocks up to the block's last query position with an online softmax.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_BLOCK_M = 16  # query tokens per program (>= 16 for tl.dot)
_BLOCK_N = 16  # key tokens per inner-loop step


@triton.jit
def _prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_table_ptr,  # [num_seqs, max_pages]
    query_start_loc_ptr,  # [num_seqs + 1]
    context_lens_ptr,  # [num_seqs]
    out_ptr,  # [num_tokens, num_heads, head_dim]
    qk_scale,  # softmax scale * log2(e): scores go through exp2
    group_size, head_dim, page_size,
    stride_qt, stride_qh, stride_qd,
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_vp, stride_vs, stride_vh, stride_vd,
    stride_pts, stride_ptp,
    stride_ot, stride_oh, stride_od,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    m_block = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    seq = tl.program_id(2).to(tl.int64)
    kv_head = head // group_size
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = (tl.load(query_start_loc_ptr + seq + 1) - q_start).to(tl.int32)
    ctx_len = tl.load(context_lens_ptr + seq).to(tl.int32)

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] index within this chunk
    row_mask = rows < q_len
    q_pos = ctx_len - q_len + rows  # [BLOCK_M] absolute position of each query token
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + (q_start + rows[:, None]) * stride_qt + head * stride_qh + d[None, :] * stride_qd,
        mask=q_mask, other=0.0,
    )  # [BLOCK_M, BLOCK_D]

    # Keys beyond the block's last query position are masked for every row: stop there.
    last_row = tl.minimum(m_block * BLOCK_M + BLOCK_M, q_len)
    hi = tl.where(m_block * BLOCK_M < q_len, ctx_len - q_len + last_row, 0)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(0, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
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

        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = n_mask[None, :] & (n[None, :] <= q_pos[:, None])  # causal with offset
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + (q_start + rows[:, None]) * stride_ot + head * stride_oh + d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences packed back to back
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [num_seqs, max_pages] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, offsets of each sequence in `query`
    context_lens: torch.Tensor,  # [num_seqs] int32, tokens in the cache incl. this chunk
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention for a chunk of query tokens per sequence over its paged context."""
    if query.dim() != 3:
        raise ValueError(
            f"query must be [num_tokens, num_heads, head_dim]; got {tuple(query.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must both be [num_pages, page_size, num_kv_heads, head_dim]; "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    _, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {k_cache.shape[3]} != query head_dim {head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if context_lens.dim() != 1:
        raise ValueError(f"context_lens must be [num_seqs]; got {tuple(context_lens.shape)}")
    num_seqs = context_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"query_start_loc must be [{num_seqs + 1}]; got {tuple(query_start_loc.shape)}"
        )
    if page_table.dim() != 2 or page_table.shape[0] != num_seqs:
        raise ValueError(
            f"page_table must be [{num_seqs}, max_pages]; got {tuple(page_table.shape)}"
        )
    for name, t in (("page_table", page_table), ("query_start_loc", query_start_loc),
                    ("context_lens", context_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64; got {t.dtype}")
    tensors = (query, k_cache, v_cache, page_table, query_start_loc, context_lens)
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")

    out = torch.empty_like(query)
    if num_seqs == 0 or query.shape[0] == 0 or num_heads == 0:
        return out
    max_q_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())  # one host sync
    if max_q_len <= 0:
        return out
    grid = (triton.cdiv(max_q_len, _BLOCK_M), num_heads, num_seqs)
    _prefill_kernel[grid](
        query, k_cache, v_cache, page_table, query_start_loc, context_lens, out,
        float(scale) * math.log2(math.e),
        num_heads // num_kv_heads, head_dim, k_cache.shape[1],
        *query.stride(), *k_cache.stride(), *v_cache.stride(), *page_table.stride(), *out.stride(),
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        INPUT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    return out
