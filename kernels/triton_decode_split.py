"""Split-K ("flash-decoding") Triton paged decode attention, for few sequences with long contexts.

The plain decode kernel (`kernels.triton_decode_attention`) runs one program per (sequence, kv
head): a batch of 2 sequences with 8 KV heads launches 16 programs on a GPU with 132 SMs, each
walking the whole context alone, so a long-context decode step uses an eighth of the machine.
Here each sequence's context is cut into `num_splits` contiguous key ranges, one program per
(sequence, kv head, split), each leaving its partial online-softmax state (running max, sum and
unnormalised accumulator, float32); a second kernel combines a sequence's splits per query head.
`paged_decode_attention` in triton_decode_attention.py picks this path when `choose_num_splits`
says more than one split pays; the result equals the one-pass kernel's up to float rounding.

Sits in the GPU path of engine/model/attention.py (decode steps), under the same arguments and
oracle (`kernels.reference.paged_decode_attention`). Tested under `TRITON_INTERPRET=1` on CPU
(tests/kernels/test_triton_decode_split.py); compiled on a GPU by tests/gpu/test_gpu_kernels.py,
which passed on an H200 on 2026-12-04 (fp32, fp16, bf16). The split heuristic's speed against the
one-pass kernel has not been measured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_paged_common import attend_paged_range, load_group_query

MIN_TOKENS_PER_SPLIT = 256  # a split shorter than this spends more on its partials than it saves
MAX_SPLITS = 32  # bounds the partials' memory and the reduce's width
DEFAULT_NUM_SMS = 132  # H100/H200, for a wrapper that cannot ask the device (the interpreter)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, num_sms: int) -> int:
    """How many splits per sequence a decode step should use (1: the one-pass kernel).

    The one-pass grid has num_seqs * num_kv_heads programs; once that fills every SM, splitting
    only adds the reduce. Otherwise split until about one program per SM, but never into splits
    shorter than MIN_TOKENS_PER_SPLIT keys (each split pays a partial write and a reduce read),
    and never past MAX_SPLITS.
    """
    programs = num_seqs * num_kv_heads
    if programs == 0 or programs >= num_sms or max_context_len < 2 * MIN_TOKENS_PER_SPLIT:
        return 1
    wanted = triton.cdiv(num_sms, programs)
    return max(1, min(wanted, max_context_len // MIN_TOKENS_PER_SPLIT, MAX_SPLITS))


def split_len_tokens(max_context_len: int, num_splits: int, block_n: int) -> int:
    """Keys per split: the context cut into num_splits, rounded up to whole key blocks so no
    block straddles two programs."""
    return triton.cdiv(triton.cdiv(max(max_context_len, 1), num_splits), block_n) * block_n


@triton.jit
def _split_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_table_ptr,  # [num_seqs, max_pages]
    context_lens_ptr,  # [num_seqs]
    part_m_ptr, part_l_ptr,  # [num_seqs, num_heads, num_splits] float32, contiguous
    part_acc_ptr,  # [num_seqs, num_heads, num_splits, head_dim] float32, contiguous
    qk_scale,  # softmax scale * log2(e): scores go through exp2
    num_heads, group_size, head_dim, page_size, num_splits, split_len,
    stride_qs, stride_qh, stride_qd,
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_vp, stride_vs, stride_vh, stride_vd,
    stride_pts, stride_ptp,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    ctx_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, ctx_len)  # lo >= hi: a split past this sequence's end

    q, heads, g_mask, d, d_mask = load_group_query(
        q_ptr, seq, kv_head, group_size, head_dim, stride_qs, stride_qh, stride_qd,
        BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D,
    )  # q: [BLOCK_G, BLOCK_D]
    m_i, l_i, acc = attend_paged_range(
        q, None, lo, hi, hi, qk_scale,  # one query token: no causal mask needed
        k_cache_ptr + kv_head * stride_kh, v_cache_ptr + kv_head * stride_vh,
        page_table_ptr + seq * stride_pts, d, d_mask, page_size, stride_ptp,
        stride_kp, stride_ks, stride_kd, stride_vp, stride_vs, stride_vd,
        ROWS=BLOCK_G, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, INPUT_PRECISION=INPUT_PRECISION,
    )  # [BLOCK_G], [BLOCK_G], [BLOCK_G, BLOCK_D]; an empty split leaves (-1e30, 0, 0)

    row = (seq * num_heads + heads) * num_splits + split  # [BLOCK_G] partials' row
    tl.store(part_m_ptr + row, m_i, mask=g_mask)
    tl.store(part_l_ptr + row, l_i, mask=g_mask)
    tl.store(part_acc_ptr + row[:, None] * head_dim + d[None, :], acc,
             mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _reduce_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr,  # as _split_kernel wrote them
    out_ptr,  # [num_seqs, num_heads, head_dim]
    num_heads, head_dim, num_splits,
    stride_os, stride_oh, stride_od,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One (sequence, query head): rescale each split's state to the largest max and add."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    d_mask = d < head_dim
    row = (seq * num_heads + head) * num_splits + s  # [BLOCK_S]
    m = tl.load(part_m_ptr + row, mask=s_mask, other=-1.0e30)
    l_s = tl.load(part_l_ptr + row, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * head_dim + d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    # Empty splits hold m = -1e30 (never -inf, so no inf - inf): their weight is exp2(-huge) = 0.
    weight = tl.exp2(m - tl.max(m, axis=0))  # [BLOCK_S]
    denom = tl.sum(weight * l_s, axis=0)
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.where(denom > 0, denom, 1.0)  # [BLOCK_D]
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


def split_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], checked by the caller
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [num_seqs, max_pages]
    context_lens: torch.Tensor,  # [num_seqs]
    qk_scale: float,  # softmax scale * log2(e)
    num_splits: int,
    out: torch.Tensor,  # [num_seqs, num_heads, head_dim], written
    block_n: int,
) -> None:
    """Both launches of the split-K path; `paged_decode_attention` checks the arguments first.

    The split length comes from the page table's width (max_pages * page_size bounds every
    context in the batch), so choosing it needs no device-to-host read of context_lens.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    max_context_len = page_table.shape[1] * k_cache.shape[1]
    split_len = split_len_tokens(max_context_len, num_splits, block_n)
    num_splits = triton.cdiv(max_context_len, split_len)  # rounding up may leave fewer splits
    part_m = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, page_table, context_lens, part_m, part_l, part_acc, qk_scale,
        num_heads, group_size, head_dim, k_cache.shape[1], num_splits, split_len,
        *query.stride(), *k_cache.stride(), *v_cache.stride(), *page_table.stride(),
        BLOCK_G=max(16, triton.next_power_of_2(group_size)),  # tl.dot needs >= 16 rows
        BLOCK_D=block_d, BLOCK_N=block_n,
        INPUT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    _reduce_kernel[(num_seqs, num_heads)](
        part_m, part_l, part_acc, out, num_heads, head_dim, num_splits, *out.stride(),
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_D=block_d,
    )
