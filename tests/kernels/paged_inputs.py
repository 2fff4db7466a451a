"""Random paged-KV inputs for the attention kernel tests: caches, shuffled page tables and
queries, built on the CPU from a seeded generator (tests/kernels/ runs them through the Triton
interpreter, tests/gpu/ moves them to CUDA), so every kernel test draws the same kind of input."""

from __future__ import annotations

import torch


def make_cache(num_pages, page_size, num_kv_heads, head_dim, dtype, gen, padded=False):
    """Random K/V caches; `padded` makes them non-contiguous views with a wider last dim."""
    width = head_dim + (8 if padded else 0)
    shape = (num_pages, page_size, num_kv_heads, width)
    k = torch.randn(shape, generator=gen).to(dtype)[..., :head_dim]
    v = torch.randn(shape, generator=gen).to(dtype)[..., :head_dim]
    return k, v


def paged_context(ctx_lens, page_size, num_kv_heads, head_dim, dtype, gen, padded=False):
    """Caches plus a page table whose pages are a shuffled, non-contiguous set; unused = -1."""
    pages_per_seq = [(c + page_size - 1) // page_size for c in ctx_lens]
    num_pages = sum(pages_per_seq) + 3  # spare pages that nobody owns
    k_cache, v_cache = make_cache(num_pages, page_size, num_kv_heads, head_dim, dtype, gen, padded)
    perm = torch.randperm(num_pages, generator=gen)
    page_table = torch.full((len(ctx_lens), max(pages_per_seq) + 1), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_seq):
        page_table[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    return k_cache, v_cache, page_table, torch.tensor(ctx_lens, dtype=torch.int32)


def query_tensor(num_tokens, num_heads, num_kv_heads, head_dim, dtype, gen, strided=False):
    """Queries, optionally as the strided q-slice of a fused qkv projection output."""
    if not strided:
        return torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    return qkv[:, :num_heads]
