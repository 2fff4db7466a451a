"""Triton paged prefill attention: causal attention for packed variable-length query chunks.

GPU path of `paged_prefill_attention` in engine/model/attention.py (prefill and chunked prefill); the
pure-torch oracle with the same arguments is `kernels.reference.paged_prefill_attention`.
Cache layout: k_cache, v_cache [num_pages, page_size, num_kv_heads, head_dim]; token t of
sequence b lives in page `page_table[b, t // page_size]` at offset `t % page_size`. The chunk's
own keys/values must already be in the cache (store_kv runs first).

Query token i of sequence b (q_len_b tokens) sits at position `context_lens[b] - q_len_b + i` and
sees keys 0..that position. FlashAttention-style: one program per (query block, head, sequence)
walks key blocks up to the block's last query position with an online softmax. That key-block
loop (`attend_paged_range`, here with the causal mask) and the host-side argument checks are
shared with the decode kernel in `kernels.triton_paged_common`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.triton_paged_common import (
    attend_paged_range,
    check_index_dtypes,
    check_page_table,
    check_query_and_cache,
    check_same_device,
    normalized_output,
)

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

    _, l_i, acc = attend_paged_range(
        q, q_pos, 0, hi, ctx_len, qk_scale,
        k_cache_ptr + kv_head * stride_kh, v_cache_ptr + kv_head * stride_vh,
        page_table_ptr + seq * stride_pts, d, d_mask, page_size, stride_ptp,
        stride_kp, stride_ks, stride_kd, stride_vp, stride_vs, stride_vd,
        ROWS=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, INPUT_PRECISION=INPUT_PRECISION,
    )
    out = normalized_output(l_i, acc)  # [BLOCK_M, BLOCK_D] float32
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
    check_query_and_cache(query, k_cache, v_cache, "num_tokens")
    _, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if context_lens.dim() != 1:
        raise ValueError(f"context_lens must be [num_seqs]; got {tuple(context_lens.shape)}")
    num_seqs = context_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"query_start_loc must be [{num_seqs + 1}]; got {tuple(query_start_loc.shape)}"
        )
    check_page_table(page_table, num_seqs)
    check_index_dtypes(
        page_table=page_table, query_start_loc=query_start_loc, context_lens=context_lens
    )
    check_same_device(query, k_cache, v_cache, page_table, query_start_loc, context_lens)

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
