"""Pure-torch paged-KV attention ops: the CPU serving path and the oracle for the Triton kernels.

Sits under engine/model/attention.py: the model's attention layer stores each step's keys/values into
the paged cache with `store_kv`, then reads them back with `paged_decode_attention` (one query
token per sequence) or `paged_prefill_attention` (a chunk of query tokens per sequence, causal,
after any context already in the cache). The Triton kernels in this package take exactly the
same arguments, so tests compare the two call for call.

Cache layout (shared by every op here and by the Triton kernels):
    k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim]
    a slot is `page_id * page_size + offset_in_page`; a negative slot means "skip this token".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Scatter each token's key/value into its slot of the paged cache (in place)."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    # A flat [num_slots, kvh, d] view makes the scatter one index_copy_ per tensor.
    k_cache.view(num_slots, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(num_slots, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def gather_kv(
    cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    page_table: torch.Tensor,  # [num_seqs, max_pages]
) -> torch.Tensor:
    """Read whole pages for each sequence: [num_seqs, max_pages * page_size, kvh, d]."""
    num_seqs, max_pages = page_table.shape
    pages = cache.index_select(0, page_table.reshape(-1).long().clamp_min(0))
    return pages.view(num_seqs, max_pages * cache.shape[1], *cache.shape[2:])


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [num_seqs, max_pages] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, includes the query token
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One query token per sequence, attending to its first `context_lens[i]` cached tokens."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    max_pages = int((int(context_lens.max()) + k_cache.shape[1] - 1) // k_cache.shape[1])
    page_table = page_table[:, :max_pages]
    keys = gather_kv(k_cache, page_table).to(query.dtype)  # [B, S, kvh, d]
    values = gather_kv(v_cache, page_table).to(query.dtype)
    seq_len = keys.shape[1]
    # Padding positions beyond each context length get -inf before softmax.
    valid = torch.arange(seq_len, device=query.device)[None, :] < context_lens[:, None].to(query.device)
    mask = valid[:, None, None, :]  # [B, 1, 1, S] broadcast over heads and query rows
    # GQA without copying K/V: the `group` query heads that share a KV head become that head's
    # query rows (one query token each, so they share the mask). Query head i reads KV head
    # i // group, as in the reference implementations.
    out = F.scaled_dot_product_attention(
        query.view(num_seqs, num_kv_heads, group, head_dim),  # [B, kvh, group, d]
        keys.transpose(1, 2),  # [B, kvh, S, d]
        values.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
    )
    return out.reshape(num_seqs, num_heads, head_dim)


def fresh_prompt_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], one whole prompt
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of one prompt over itself, from the K/V in hand (no cached context)."""
    return _sdpa(query, key, value, None, scale)


def _sdpa(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
          scale: float) -> torch.Tensor:  # [q_len, h, d]
    """Token-major [len, heads, d] tensors through torch's fused SDPA: causal when `mask` is
    None (a whole prompt, square), else under the boolean [q_len, S] mask. On CPU that is the
    flash kernel, which multiplies with AMX where the CPU has it (bf16 on such a CPU: 3-4x the
    compiled kernel of kernels/cpu/, see engine/model/attention.py). The inputs go in 4-D
    ([1, h, len, d]: CPU SDPA takes its slow path otherwise); `enable_gqa` shares each KV head
    with its query-head group without copying it (as fast as a repeated copy, or faster, on
    torch 2.13)."""
    return F.scaled_dot_product_attention(
        query.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True,
    )[0].transpose(0, 1)


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences packed back to back
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [num_seqs, max_pages] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, offsets of each sequence in `query`
    context_lens: torch.Tensor,  # [num_seqs] int32, tokens in the cache incl. this chunk
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention for a chunk of query tokens per sequence over its paged context.

    Query token i of sequence b sits at position `context_lens[b] - q_len_b + i` and sees keys
    at positions 0..that position (earlier chunks and cached prefix pages included).
    """
    out = torch.empty_like(query)
    page_size = k_cache.shape[1]
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    for b, ctx_len in enumerate(lens):
        q = query[starts[b] : starts[b + 1]]  # [q_len, h, d]
        q_len = q.shape[0]
        if q_len == 0:
            continue
        num_pages = (ctx_len + page_size - 1) // page_size
        pages = page_table[b, :num_pages].long()
        keys = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:ctx_len].to(query.dtype)
        values = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:ctx_len].to(query.dtype)
        mask = None  # a chunk with no context before it is plain causal
        if ctx_len > q_len:
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)
            mask = torch.arange(ctx_len, device=query.device)[None, :] <= q_pos[:, None]  # [q_len, S]
        out[starts[b] : starts[b + 1]] = _sdpa(q, keys, values, mask, scale)
    return out
