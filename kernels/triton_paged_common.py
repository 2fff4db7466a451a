"""Pieces shared by the Triton paged-KV kernels: jit helpers and host-side argument checks.

Used by `kernels.triton_decode_attention`, `kernels.triton_decode_split` and
`kernels.triton_prefill_attention` (the GPU path of
`paged_decode_attention` / `paged_prefill_attention` in engine/model/attention.py) and by
`kernels.triton_store_kv` (the GPU path of `store_kv`); the pure-torch oracles with the same
arguments live in `kernels.reference`. Nothing here is public API.

Cache layout: k_cache, v_cache [num_pages, page_size, num_kv_heads, head_dim]; token t of
sequence b lives in page `page_table[b, t // page_size]` at offset `t % page_size`.

- `load_kv_tiles`: the [BLOCK_N, BLOCK_D] K and V tiles of one sequence and kv head.
- `load_group_query`: the query rows of one kv head's GQA group (both decode kernels).
- `online_softmax_update`: one step of the exp2 online softmax (running max / denominator /
  accumulator), so a kernel can walk the context block by block in constant memory.
- `attend_paged_range`: the key-block loop over keys lo..end-1, built from the two above,
  returning the unnormalised softmax state: decode runs it over the whole context without a
  causal mask, prefill with one, the split-K decode kernel over one key range per split.
- `normalized_output`: that state divided out into the attention output.
- `check_*`: the ValueError checks the host wrappers run before launching a kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# ---------------------------------------------------------------------------------------------
# Device-side helpers (inlined into the calling kernel).
# ---------------------------------------------------------------------------------------------


@triton.jit
def load_kv_tiles(
    k_head_ptr, v_head_ptr,  # k_cache / v_cache already advanced to this kv head
    page_row_ptr,  # this sequence's row of page_table [max_pages]
    n, n_mask,  # [BLOCK_N] key positions; n_mask: positions to load (others read as 0)
    d, d_mask,  # [BLOCK_D] (padded head_dim) and which lanes are < head_dim
    page_size, stride_ptp,
    stride_kp, stride_ks, stride_kd,
    stride_vp, stride_vs, stride_vd,
):
    """K and V tiles [BLOCK_N, BLOCK_D] for key positions `n`, in the cache dtype."""
    page = tl.load(page_row_ptr + (n // page_size) * stride_ptp, mask=n_mask, other=0).to(tl.int64)
    in_page = (n % page_size).to(tl.int64)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(
        k_head_ptr + page[:, None] * stride_kp + in_page[:, None] * stride_ks
        + d[None, :] * stride_kd,
        mask=kv_mask, other=0.0,
    )  # [BLOCK_N, BLOCK_D]
    v = tl.load(
        v_head_ptr + page[:, None] * stride_vp + in_page[:, None] * stride_vs
        + d[None, :] * stride_vd,
        mask=kv_mask, other=0.0,
    )  # [BLOCK_N, BLOCK_D]
    return k, v


@triton.jit
def load_group_query(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    seq, kv_head, group_size, head_dim,
    stride_qs, stride_qh, stride_qd,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """A decode step's query rows for one kv head's GQA group: returns (q [BLOCK_G, BLOCK_D],
    heads [BLOCK_G], g_mask [BLOCK_G], d [BLOCK_D], d_mask [BLOCK_D]); padded rows/lanes are 0."""
    g = tl.arange(0, BLOCK_G)  # [BLOCK_G] query heads of this group (padded)
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D] (padded head_dim)
    heads = kv_head * group_size + g
    g_mask = g < group_size
    d_mask = d < head_dim
    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )  # [BLOCK_G, BLOCK_D]
    return q, heads, g_mask, d, d_mask


@triton.jit
def online_softmax_update(
    m_i,  # [ROWS] running max of the scores (log2 domain)
    l_i,  # [ROWS] running softmax denominator
    acc,  # [ROWS, BLOCK_D] running (unnormalised) output, float32
    s,  # [ROWS, BLOCK_N] scores * scale * log2(e), -inf where a key is not visible
    v,  # [BLOCK_N, BLOCK_D] value tile
    INPUT_PRECISION: tl.constexpr,
):
    """Fold one block of scores and values into the running state; returns (m_i, l_i, acc)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def attend_paged_range(
    q,  # [ROWS, BLOCK_D] query tile; its dtype is the dtype K and V are computed in
    q_pos,  # [ROWS] absolute position of each query row, keys after it are masked; None: no
    #         causal mask (every key below `end` is visible)
    lo,  # first key position to walk (a split's start; 0 for the whole context)
    hi,  # walk key positions lo..hi-1 in BLOCK_N steps
    end,  # keys at positions >= end are masked (the context length, or a split's end)
    qk_scale,  # softmax scale * log2(e): scores go through exp2
    k_head_ptr, v_head_ptr,  # k_cache / v_cache already advanced to this kv head
    page_row_ptr,  # this sequence's row of page_table [max_pages]
    d, d_mask,  # [BLOCK_D] (padded head_dim) and which lanes are < head_dim
    page_size, stride_ptp,
    stride_kp, stride_ks, stride_kd,
    stride_vp, stride_vs, stride_vd,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """The online-softmax state (m_i [ROWS], l_i [ROWS], acc [ROWS, BLOCK_D], all float32,
    acc not yet divided by l_i) of q against keys lo..end-1 of one sequence's paged context.

    An empty range (lo >= hi) returns m_i = -1e30, l_i = 0, acc = 0: a finite "no keys" state
    that a split-K reduce can weigh to zero without producing NaN.
    """
    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([ROWS], dtype=tl.float32)  # running softmax denominator
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        n_mask = n < end
        k, v = load_kv_tiles(
            k_head_ptr, v_head_ptr, page_row_ptr, n, n_mask, d, d_mask, page_size, stride_ptp,
            stride_kp, stride_ks, stride_kd, stride_vp, stride_vs, stride_vd,
        )  # [BLOCK_N, BLOCK_D] each
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=INPUT_PRECISION) * qk_scale
        visible = n_mask[None, :]
        if q_pos is not None:
            visible = visible & (n[None, :] <= q_pos[:, None])  # causal with offset
        s = tl.where(visible, s, float("-inf"))  # [ROWS, BLOCK_N]
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, s, v.to(q.dtype), INPUT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def normalized_output(l_i, acc):
    """attend_paged_range's state as the attention output [ROWS, BLOCK_D] float32: acc divided
    by the softmax denominator; a row that saw no key gets zeros, not NaN."""
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None]


# ---------------------------------------------------------------------------------------------
# Host-side argument checks (each raises ValueError).
# ---------------------------------------------------------------------------------------------


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """k_cache and v_cache must both be [num_pages, page_size, num_kv_heads, head_dim]."""
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must both be [num_pages, page_size, num_kv_heads, head_dim]; "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )


def check_query_and_cache(
    query: torch.Tensor,  # [rows, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: str,  # what the query's first dim counts, for the message: "num_seqs" / "num_tokens"
) -> None:
    """Query/cache shapes of the attention wrappers: head_dim matches, heads divide into groups."""
    if query.dim() != 3:
        raise ValueError(f"query must be [{rows}, num_heads, head_dim]; got {tuple(query.shape)}")
    check_kv_cache(k_cache, v_cache)
    _, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {k_cache.shape[3]} != query head_dim {head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")


def check_page_table(page_table: torch.Tensor, num_seqs: int) -> None:
    """page_table must be [num_seqs, max_pages]."""
    if page_table.dim() != 2 or page_table.shape[0] != num_seqs:
        raise ValueError(
            f"page_table must be [{num_seqs}, max_pages]; got {tuple(page_table.shape)}"
        )


def check_index_dtypes(**tensors: torch.Tensor) -> None:
    """Index tensors (page tables, lengths, offsets, slots) must be int32 or int64."""
    for name, t in tensors.items():
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64; got {t.dtype}")


def check_same_device(*tensors: torch.Tensor) -> None:
    """Every tensor handed to a kernel must live on one device."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")
