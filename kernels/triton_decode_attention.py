"""Triton paged decode attention: one query token per sequence over its paged KV context.

GPU path of `paged_decode_attention` in engine/model/attention.py (decode steps); the pure-torch
oracle with the same arguments is `kernels.reference.paged_decode_attention`.
Cache layout: k_cache, v_cache [num_pages, page_size, num_kv_heads, head_dim]; token t of
sequence b lives in page `page_table[b, t // page_size]` at offset `t % page_size`.

One program per (sequence, kv head) handles every query head of that GQA group at once, so each
key/value block is loaded once per group. It walks the context in BLOCK_N-token blocks with an
online softmax (running max / running sum), so memory use does not grow with context length.
That key-block loop (`attend_paged_range`) and the host-side argument checks are shared with
the prefill kernel in `kernels.triton_paged_common`. Few sequences with long contexts would
leave most of a GPU idle in that grid; for them `paged_decode_attention` takes the split-K path
of `kernels.triton_decode_split` instead (`choose_num_splits` decides).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kernels.triton_decode_split import DEFAULT_NUM_SMS, choose_num_splits, split_decode_attention
from kernels.triton_paged_common import (
    attend_paged_range,
    check_index_dtypes,
    check_page_table,
    check_query_and_cache,
    check_same_device,
    load_group_query,
    normalized_output,
)

_BLOCK_N = 32  # context tokens per inner-loop step (>= 16 for tl.dot)


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the device the kernel runs on (a default off CUDA, where
    only the interpreter runs it)."""
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


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

    q, heads, g_mask, d, d_mask = load_group_query(
        q_ptr, seq, kv_head, group_size, head_dim, stride_qs, stride_qh, stride_qd,
        BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D,
    )  # q: [BLOCK_G, BLOCK_D]

    _, l_i, acc = attend_paged_range(
        q, None, 0, ctx_len, ctx_len, qk_scale,  # one query token: no causal mask needed
        k_cache_ptr + kv_head * stride_kh, v_cache_ptr + kv_head * stride_vh,
        page_table_ptr + seq * stride_pts, d, d_mask, page_size, stride_ptp,
        stride_kp, stride_ks, stride_kd, stride_vp, stride_vs, stride_vd,
        ROWS=BLOCK_G, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, INPUT_PRECISION=INPUT_PRECISION,
    )
    out = normalized_output(l_i, acc)  # [BLOCK_G, BLOCK_D] float32
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
    num_splits: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One query token per sequence, attending to its first `context_lens[i]` cached tokens.

    `num_splits`: key-range splits per sequence (the split-K path of triton_decode_split.py when
    > 1); None lets `choose_num_splits` decide from the batch size, KV heads and the page table's
    width, the same answer for the same shapes (no device read)."""
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
    qk_scale = float(scale) * math.log2(math.e)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, page_table.shape[1] * k_cache.shape[1],
                                       _num_sms(query.device))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1; got {num_splits}")
    if num_splits > 1:
        split_decode_attention(query, k_cache, v_cache, page_table, context_lens, qk_scale,
                               num_splits, out, _BLOCK_N)
        return out
    group_size = num_heads // num_kv_heads
    _decode_kernel[(num_seqs, num_kv_heads)](
        query, k_cache, v_cache, page_table, context_lens, out,
        qk_scale, group_size, head_dim, k_cache.shape[1],
        *query.stride(), *k_cache.stride(), *v_cache.stride(), *page_table.stride(), *out.stride(),
        BLOCK_G=max(16, triton.next_power_of_2(group_size)),  # tl.dot needs >= 16 rows
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=_BLOCK_N,
        INPUT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    return out
