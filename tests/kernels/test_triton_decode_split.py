"""The split-K decode path (kernels/triton_decode_split.py) vs the pure-torch oracle, under the
Triton interpreter, and the split heuristic as a plain function.

Contexts are tens of tokens so the interpreter stays in seconds; the path is forced with
`num_splits` because the heuristic only splits contexts of hundreds of tokens.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import pytest
import torch

pytest.importorskip("triton")

from kernels import reference
from kernels.triton_decode_attention import paged_decode_attention
from kernels.triton_decode_split import (
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    choose_num_splits,
    split_len_tokens,
)
from tests.kernels.paged_inputs import paged_context, query_tensor

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-4), torch.float16: dict(atol=1e-2, rtol=1e-2)}


@pytest.mark.parametrize(
    "ctx_lens,page_size,num_heads,num_kv_heads,head_dim,dtype,num_splits",
    [
        # Splits of 32 keys over pages of 4: split edges inside and on page boundaries;
        # 1 (a single-page context: later splits are empty), 45 (not a split multiple), 96.
        ([1, 45, 96], 4, 4, 2, 16, torch.float32, 3),
        ([70], 16, 8, 2, 32, torch.float32, 4),  # GQA 4, one sequence, last split partial
        ([33, 64], 16, 4, 1, 24, torch.float32, 3),  # MQA, head_dim padded; 64 = whole pages
        ([3, 50], 4, 4, 2, 32, torch.float16, 2),
        ([5], 16, 2, 2, 16, torch.float32, 5),  # more splits asked than the context has blocks
    ],
)
def test_split_decode_matches_reference(ctx_lens, page_size, num_heads, num_kv_heads, head_dim, dtype, num_splits):
    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache, page_table, context_lens = paged_context(
        ctx_lens, page_size, num_kv_heads, head_dim, dtype, gen
    )
    query = query_tensor(len(ctx_lens), num_heads, num_kv_heads, head_dim, dtype, gen)
    args = (query, k_cache, v_cache, page_table, context_lens, head_dim**-0.5)
    expected = reference.paged_decode_attention(*args)
    actual = paged_decode_attention(*args, num_splits=num_splits)
    assert actual.shape == query.shape and actual.dtype == query.dtype
    torch.testing.assert_close(actual, expected, **TOL[dtype])
    # The one-pass kernel agrees with the split one, not only with the oracle.
    torch.testing.assert_close(actual, paged_decode_attention(*args, num_splits=1), **TOL[dtype])


def test_split_decode_with_a_strided_query_and_cache():
    """The q-slice of a fused qkv output and caches with padded rows, as the engine hands them."""
    gen = torch.Generator().manual_seed(8)
    k_cache, v_cache, page_table, context_lens = paged_context([40, 17], 4, 2, 16, torch.float32, gen, padded=True)
    query = query_tensor(2, 4, 2, 16, torch.float32, gen, strided=True)
    args = (query, k_cache, v_cache, page_table, context_lens, 0.25)
    torch.testing.assert_close(paged_decode_attention(*args, num_splits=2), reference.paged_decode_attention(*args),
                               **TOL[torch.float32])


def test_num_splits_below_one_is_a_value_error():
    k_cache = torch.zeros(2, 4, 2, 16)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(torch.zeros(1, 2, 16), k_cache, k_cache, torch.zeros(1, 2, dtype=torch.int32),
                               torch.ones(1, dtype=torch.int32), 1.0, num_splits=0)


def test_the_heuristic_splits_only_few_long_sequences():
    sms = 132
    # A full grid already (64 seqs x 8 kv heads >= 132 programs): no split.
    assert choose_num_splits(64, 8, 32_768, sms) == 1
    # Short contexts never split, whatever the grid.
    assert choose_num_splits(1, 8, 2 * MIN_TOKENS_PER_SPLIT - 1, sms) == 1
    # One sequence, 8 kv heads, long context: about one program per SM (132 / 8 -> 17 splits).
    assert choose_num_splits(1, 8, 32_768, sms) == 17
    # Splits stay at least MIN_TOKENS_PER_SPLIT keys long...
    assert choose_num_splits(1, 8, 4 * MIN_TOKENS_PER_SPLIT, sms) == 4
    # ...and at most MAX_SPLITS.
    assert choose_num_splits(1, 1, 1_000_000, sms) == MAX_SPLITS
    assert choose_num_splits(0, 8, 32_768, sms) == 1


def test_split_lengths_are_whole_key_blocks_covering_the_context():
    for ctx, splits in [(1, 3), (45, 3), (96, 3), (32_768, 17), (5, 5)]:
        length = split_len_tokens(ctx, splits, 32)
        assert length % 32 == 0 and length * splits >= ctx and length >= 32
