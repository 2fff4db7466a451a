"""Each compiled Triton kernel (store, prefill, decode one-pass and split-K) against the pure-torch
oracle (kernels/reference.py) on CUDA, in the serving dtypes. The same comparisons run under the
interpreter on CPU in tests/kernels/; here the compiled code and real tensor cores are checked.

Ran and passed on an NVIDIA H200 on 2026-12-04 (docs/benchmarks.md, "The GPU check"); skipped
with the reason where there is no CUDA.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.gpu_env import requires_compiled_triton
from tests.kernels.paged_inputs import paged_context, query_tensor

pytestmark = [pytest.mark.gpu, requires_compiled_triton]

# bf16 through tensor cores against the oracle's float math on bf16 inputs: looser than fp16.
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-3), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _on_cuda(*tensors):
    return [t.to("cuda") for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_compiled_matches_reference(dtype):
    from kernels import reference
    from kernels.triton_store_kv import store_kv

    gen = torch.Generator().manual_seed(0)
    k_ref, v_ref, _, _ = paged_context([64, 40], 16, 8, 128, dtype, gen)
    k_ref, v_ref = _on_cuda(k_ref.contiguous(), v_ref.contiguous())
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    key, value = _on_cuda(torch.randn(50, 8, 128, generator=gen), torch.randn(50, 8, 128, generator=gen))
    slots = torch.randperm(k_ref.shape[0] * 16, generator=gen)[:50].cuda()
    slots[[3, 17]] = -1
    reference.store_kv(key, value, k_ref, v_ref, slots)
    store_kv(key, value, k_tri, v_tri, slots)
    torch.testing.assert_close(k_tri, k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v_tri, v_ref, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 4, None])  # one pass, forced split-K, the heuristic's choice
@pytest.mark.parametrize("ctx_lens,num_heads,num_kv_heads", [
    ([1, 17, 300, 2048], 32, 8),  # mixed lengths, GQA 4
    ([8191], 32, 8),  # one long sequence: the case split-K is for (the heuristic splits it)
    ([513, 1000], 16, 16),  # MHA
])
def test_decode_compiled_matches_reference(dtype, num_splits, ctx_lens, num_heads, num_kv_heads):
    from kernels import reference
    from kernels.triton_decode_attention import paged_decode_attention

    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache, page_table, context_lens = _on_cuda(*paged_context(ctx_lens, 16, num_kv_heads, 128, dtype, gen))
    page_table.clamp_(min=0)  # the engine pads with page 0, not -1
    query = query_tensor(len(ctx_lens), num_heads, num_kv_heads, 128, dtype, gen).cuda()
    args = (query, k_cache, v_cache, page_table, context_lens, 128**-0.5)
    expected = reference.paged_decode_attention(*args)
    actual = paged_decode_attention(*args, num_splits=num_splits)
    torch.testing.assert_close(actual, expected, **TOL[dtype])


def test_the_heuristic_splits_a_long_single_sequence_on_this_device():
    from kernels.triton_decode_split import choose_num_splits

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert choose_num_splits(1, 8, 8192, sms) > 1
    assert choose_num_splits(256, 8, 8192, sms) == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_compiled_matches_reference(dtype):
    from kernels import reference
    from kernels.triton_prefill_attention import paged_prefill_attention

    gen = torch.Generator().manual_seed(2)
    q_lens, ctx_lens = [300, 1, 64], [300, 700, 1000]  # a fresh prompt, a decode-like row, a chunk
    k_cache, v_cache, page_table, context_lens = _on_cuda(*paged_context(ctx_lens, 16, 8, 128, dtype, gen))
    page_table.clamp_(min=0)
    query = query_tensor(sum(q_lens), 32, 8, 128, dtype, gen).cuda()
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32).cuda()
    args = (query, k_cache, v_cache, page_table, starts, context_lens, 128**-0.5)
    torch.testing.assert_close(paged_prefill_attention(*args), reference.paged_prefill_attention(*args), **TOL[dtype])
