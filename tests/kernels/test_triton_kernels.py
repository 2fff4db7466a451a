"""Triton kernels vs the pure-torch oracle in kernels/reference.py, under the Triton interpreter.

Shapes are tiny because the interpreter runs every program in Python on the CPU.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import pytest
import torch

pytest.importorskip("triton")

from kernels import reference
from kernels.triton_decode_attention import paged_decode_attention
from kernels.triton_prefill_attention import paged_prefill_attention
from kernels.triton_store_kv import store_kv
from tests.kernels.paged_inputs import make_cache, paged_context, query_tensor

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-4), torch.float16: dict(atol=1e-2, rtol=1e-2)}


@pytest.mark.parametrize(
    "page_size,num_kv_heads,head_dim,dtype,strided",
    [
        (4, 1, 16, torch.float32, False),
        (16, 2, 32, torch.float32, True),
        (4, 3, 24, torch.float16, False),  # non-power-of-two heads and head_dim
    ],
)
def test_store_kv_matches_reference(page_size, num_kv_heads, head_dim, dtype, strided):
    gen = torch.Generator().manual_seed(0)
    num_pages, num_tokens = 6, 11
    k_ref, v_ref = make_cache(num_pages, page_size, num_kv_heads, head_dim, dtype, gen)
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    if strided:  # keys/values as slices of one [tokens, 2, kvh, d] buffer
        kv = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=gen)
        key, value = kv[:, 0], kv[:, 1]
    else:
        key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
        value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:num_tokens]
    slots[[1, 4, 9]] = -1  # skipped tokens (e.g. padding)
    reference.store_kv(key, value, k_ref, v_ref, slots)
    store_kv(key, value, k_tri, v_tri, slots)
    torch.testing.assert_close(k_tri, k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v_tri, v_ref, atol=0, rtol=0)


@pytest.mark.parametrize(
    "ctx_lens,page_size,num_heads,num_kv_heads,head_dim,dtype,padded",
    [
        ([1, 7, 16, 37], 4, 2, 2, 16, torch.float32, False),  # MHA, mid-page and page multiple
        ([5, 33], 16, 4, 2, 32, torch.float32, True),  # GQA 2, strided query and cache
        ([16, 1, 64], 16, 8, 2, 64, torch.float32, False),  # GQA 4, whole pages only
        ([9, 20], 4, 4, 1, 24, torch.float32, False),  # MQA, head_dim padded to 32
        ([3, 30], 4, 4, 2, 32, torch.float16, False),
        ([2, 48, 17, 4, 32], 16, 8, 2, 16, torch.float16, True),  # five seqs, GQA 4
    ],
)
def test_decode_matches_reference(
    ctx_lens, page_size, num_heads, num_kv_heads, head_dim, dtype, padded
):
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache, page_table, context_lens = paged_context(
        ctx_lens, page_size, num_kv_heads, head_dim, dtype, gen, padded
    )
    query = query_tensor(len(ctx_lens), num_heads, num_kv_heads, head_dim, dtype, gen, strided=padded)
    scale = head_dim**-0.5
    args = (query, k_cache, v_cache, page_table, context_lens, scale)
    expected = reference.paged_decode_attention(*args)
    actual = paged_decode_attention(*args)
    assert actual.shape == query.shape and actual.dtype == query.dtype
    torch.testing.assert_close(actual, expected, **TOL[dtype])


@pytest.mark.parametrize(
    "q_lens,ctx_lens,page_size,num_heads,num_kv_heads,head_dim,dtype,padded",
    [
        ([5, 17], [5, 17], 4, 2, 2, 16, torch.float32, False),  # fresh prompts, no prior cache
        ([3, 1, 20], [10, 16, 33], 16, 4, 2, 32, torch.float32, True),  # chunks after cached prefix
        ([18], [40], 4, 8, 2, 64, torch.float32, False),  # GQA 4, two query blocks
        ([1, 6], [1, 9], 4, 4, 1, 24, torch.float32, False),  # MQA, length-1 prompt
        ([7, 12], [12, 12], 4, 4, 2, 32, torch.float16, False),
        ([16, 32, 2], [32, 48, 19], 16, 2, 1, 16, torch.float16, True),  # page-multiple chunks
    ],
)
def test_prefill_matches_reference(
    q_lens, ctx_lens, page_size, num_heads, num_kv_heads, head_dim, dtype, padded
):
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache, page_table, context_lens = paged_context(
        ctx_lens, page_size, num_kv_heads, head_dim, dtype, gen, padded
    )
    query = query_tensor(sum(q_lens), num_heads, num_kv_heads, head_dim, dtype, gen, strided=padded)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = head_dim**-0.5
    args = (query, k_cache, v_cache, page_table, query_start_loc, context_lens, scale)
    expected = reference.paged_prefill_attention(*args)
    actual = paged_prefill_attention(*args)
    assert actual.shape == query.shape and actual.dtype == query.dtype
    torch.testing.assert_close(actual, expected, **TOL[dtype])


def test_store_then_prefill_then_decode():
    """The engine's flow: store a prompt, prefill over it, store one more token, decode."""
    gen = torch.Generator().manual_seed(3)
    page_size, num_heads, num_kv_heads, head_dim = 4, 4, 2, 16
    prompt_lens = [6, 9]
    k_cache, v_cache, page_table, _ = paged_context(
        [n + 1 for n in prompt_lens], page_size, num_kv_heads, head_dim, torch.float32, gen
    )
    k_cache.zero_(), v_cache.zero_()

    def slots_for(positions):  # [(seq, pos)] -> slot ids
        return torch.tensor(
            [int(page_table[b, p // page_size]) * page_size + p % page_size for b, p in positions]
        )

    def step(positions, ctx_lens, q_lens):
        n = len(positions)
        key = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        value = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        store_kv(key, value, k_cache, v_cache, slots_for(positions))
        query = torch.randn(n, num_heads, head_dim, generator=gen)
        lens = torch.tensor(ctx_lens, dtype=torch.int32)
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        return query, lens, qsl

    positions = [(b, p) for b, n in enumerate(prompt_lens) for p in range(n)]
    query, lens, qsl = step(positions, prompt_lens, prompt_lens)
    args = (query, k_cache, v_cache, page_table, qsl, lens, 0.25)
    expected = reference.paged_prefill_attention(*args)
    torch.testing.assert_close(paged_prefill_attention(*args), expected)

    next_positions = [(b, n) for b, n in enumerate(prompt_lens)]
    query, lens, _ = step(next_positions, [n + 1 for n in prompt_lens], [1, 1])
    args = (query, k_cache, v_cache, page_table, lens, 0.25)
    expected = reference.paged_decode_attention(*args)
    torch.testing.assert_close(paged_decode_attention(*args), expected)


def test_shape_errors_are_value_errors():
    k_cache = torch.zeros(2, 4, 2, 16)
    table = torch.zeros(1, 2, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention(torch.zeros(1, 3, 16), k_cache, k_cache, table, lens, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(torch.zeros(1, 2, 8), k_cache, k_cache, table, lens, 1.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(torch.zeros(1, 2, 16), k_cache, k_cache, table, lens, lens, 1.0)
    with pytest.raises(ValueError, match="slot_mapping"):
        kv = torch.zeros(3, 2, 16)
        store_kv(kv, kv, k_cache, k_cache, torch.zeros(2, dtype=torch.long))
