"""The compiled CPU kernels (kernels/cpu_ops.py) vs the pure-torch oracle in kernels/reference.py.

One call of `cpu_ops.paged_attention` covers a whole mixed batch (decodes, prefill chunks with
and without cached context); the oracle runs the decode and prefill ops on the same slices.
Pages are a shuffled, non-contiguous set, as the page manager hands them out.
"""

import pytest
import torch

from kernels import cpu_ops, reference

if cpu_ops.load() is None:
    pytest.skip(f"CPU extension unavailable: {cpu_ops.load_error()}", allow_module_level=True)

TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-4),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


def _paged_batch(q_lens, ctx_lens, page_size, num_heads, num_kv_heads, head_dim, dtype, gen):
    pages_per_seq = [(c + page_size - 1) // page_size for c in ctx_lens]
    num_pages = sum(pages_per_seq) + 3  # spare pages that nobody owns
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
    table = torch.full((len(ctx_lens), max(pages_per_seq) + 1), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_seq):
        table[b, :n] = perm[used : used + n]
        used += n
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    # The q-slice of a fused qkv output: strided rows, as the model passes it.
    qkv = torch.randn(int(starts[-1]), num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    return qkv[:, :num_heads], k_cache, v_cache, table, starts, torch.tensor(ctx_lens, dtype=torch.int32)


def _oracle(query, k_cache, v_cache, table, starts, lens, num_decode, scale):
    out = torch.empty_like(query)
    if num_decode:
        out[:num_decode] = reference.paged_decode_attention(
            query[:num_decode], k_cache, v_cache, table[:num_decode], lens[:num_decode], scale)
    if num_decode < lens.shape[0]:
        rest = starts[num_decode:]
        out[int(rest[0]):] = reference.paged_prefill_attention(
            query[int(rest[0]):], k_cache, v_cache, table[num_decode:], rest - rest[0], lens[num_decode:], scale)
    return out


@pytest.mark.parametrize(
    "page_size,num_heads,num_kv_heads,head_dim,dtype",
    [
        (16, 12, 4, 64, torch.float32),  # builtin:small's shape
        (4, 4, 4, 32, torch.float32),  # no GQA
        (8, 8, 1, 128, torch.float32),  # multi-query
        (16, 6, 2, 48, torch.float32),  # odd vector count per row
        (16, 12, 4, 64, torch.bfloat16),
        (32, 4, 2, 16, torch.float16),
        (1, 4, 2, 64, torch.float32),  # one token per page
        # bf16 prefill tiles take the matrix-product path (kernels/cpu/prefill_tile_bf16.h) where
        # the CPU has AVX512-BF16 and head_dim is a multiple of 32, the vector path elsewhere.
        (4, 4, 4, 32, torch.bfloat16),
        (8, 8, 1, 128, torch.bfloat16),
        (16, 6, 2, 48, torch.bfloat16),
        (1, 4, 2, 64, torch.bfloat16),
        (16, 4, 2, 256, torch.bfloat16),
    ],
)
def test_mixed_batch_matches_reference(page_size, num_heads, num_kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(page_size * 1000 + head_dim)
    # Three decodes (one at context 1), a fresh prompt longer than a query tile, a chunk after
    # cached context, a one-token chunk after context.
    q_lens = [1, 1, 1, 37, 20, 1]
    ctx_lens = [1, 45, 130, 37, 83, 9]
    num_decode = 3
    query, k_cache, v_cache, table, starts, lens = _paged_batch(
        q_lens, ctx_lens, page_size, num_heads, num_kv_heads, head_dim, dtype, gen)
    scale = head_dim**-0.5
    got = cpu_ops.paged_attention(query, k_cache, v_cache, table, starts, lens, scale)
    want = _oracle(query, k_cache, v_cache, table, starts, lens, num_decode, scale)
    assert got.dtype == dtype and got.shape == query.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_bf16_prefill_over_long_context_matches_reference():
    """Chunks over a thousand cached tokens and a long fresh prompt: many key blocks per tile
    (the bf16 matrix-product path where the CPU has AVX512-BF16), against the oracle and, in
    fp32 on the same bf16 inputs, no further than bf16 rounding of the output."""
    gen = torch.Generator().manual_seed(5)
    q_lens, ctx_lens = [64, 300, 7], [1064, 300, 1207]
    query, k_cache, v_cache, table, starts, lens = _paged_batch(q_lens, ctx_lens, 16, 12, 4, 64, torch.bfloat16, gen)
    got = cpu_ops.paged_attention(query, k_cache, v_cache, table, starts, lens, 0.125)
    want = _oracle(query, k_cache, v_cache, table, starts, lens, 0, 0.125)
    torch.testing.assert_close(got.float(), want.float(), **TOL[torch.bfloat16])
    exact = _oracle(query.float(), k_cache.float(), v_cache.float(), table, starts, lens, 0, 0.125)
    assert (got.float() - exact).abs().mean() < 2e-3


def test_parallel_threads_give_the_same_result():
    gen = torch.Generator().manual_seed(7)
    query, k_cache, v_cache, table, starts, lens = _paged_batch(
        [1] * 9 + [50], [300] * 9 + [70], 16, 12, 4, 64, torch.float32, gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_ops.paged_attention(query, k_cache, v_cache, table, starts, lens, 0.125)
        torch.set_num_threads(2)
        two = cpu_ops.paged_attention(query, k_cache, v_cache, table, starts, lens, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # items are independent: no reduction order depends on threads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_reference_and_skips_negative_slots(dtype):
    gen = torch.Generator().manual_seed(3)
    shape = (6, 4, 2, 32)
    key = torch.randn(5, 2, 32, generator=gen)  # float32 in: stored in the cache's dtype
    value = torch.randn(5, 2, 32, generator=gen)
    slots = torch.tensor([0, 7, -1, 23, 12], dtype=torch.int64)
    caches = [torch.zeros(shape, dtype=dtype) for _ in range(4)]
    cpu_ops.store_kv(key, value, caches[0], caches[1], slots)
    reference.store_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].view(-1, 2, 32)[8:12].abs().sum() == 0  # untouched slots stay zero


def test_bad_arguments_raise_with_their_reason():
    gen = torch.Generator().manual_seed(1)
    query, k_cache, v_cache, table, starts, lens = _paged_batch([1, 4], [10, 4], 4, 4, 2, 32, torch.float32, gen)
    with pytest.raises(RuntimeError, match="must be int32"):
        cpu_ops.paged_attention(query, k_cache, v_cache, table.long(), starts, lens, 1.0)
    with pytest.raises(RuntimeError, match="more query tokens than context"):
        cpu_ops.paged_attention(query, k_cache, v_cache, table, starts, torch.tensor([10, 3], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="more context than its page table row covers"):
        cpu_ops.paged_attention(query, k_cache, v_cache, table[:, :1], starts, lens, 1.0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_ops.paged_attention(query.double(), k_cache, v_cache, table, starts, lens, 1.0)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_ops.store_kv(torch.zeros(1, 2, 32), torch.zeros(1, 2, 32), k_cache, v_cache,
                         torch.tensor([10**6]))


def test_build_is_cached_per_source_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_EXT_DIR", str(tmp_path))
    directory = cpu_ops.build_dir()
    assert directory.parent == tmp_path
    assert directory == cpu_ops.build_dir()  # the same source on the same CPU: the same build
    monkeypatch.setattr(cpu_ops, "_cpu_signature", lambda: "another-cpu")
    assert cpu_ops.build_dir() != directory  # another processor never loads this build


@pytest.mark.parametrize("rows", [1, 2, 3, 16, 33])
@pytest.mark.parametrize("dtype,bias", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)])
def test_skinny_linear_matches_f_linear(rows, dtype, bias):
    gen = torch.Generator().manual_seed(rows)
    # 131 output features: a tail that is not a whole tile of 4 weight rows.
    weight = torch.randn(131, 96, generator=gen).to(dtype)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    b = torch.randn(131, generator=gen).to(dtype) if bias else None
    got = cpu_ops.skinny_linear(x, weight, b)
    want = torch.nn.functional.linear(x.float(), weight.float(), None if b is None else b.float())
    assert got.dtype == dtype and got.shape == (rows, 131)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


def test_skinny_linear_refuses_shapes_it_does_not_serve():
    with pytest.raises(RuntimeError, match="multiple of 8"):
        cpu_ops.skinny_linear(torch.zeros(1, 12), torch.zeros(4, 12))
    with pytest.raises(RuntimeError, match="takes x"):
        cpu_ops.skinny_linear(torch.zeros(1, 16), torch.zeros(4, 8))


def test_engine_linear_takes_the_skinny_kernel_only_for_few_rows():
    from engine.model.layers import SKINNY_MAX_ROWS, linear

    calls = []

    def skinny(x, w, b):
        calls.append(x.shape[0])
        return cpu_ops.skinny_linear(x, w, b)

    weight = torch.randn(16, 64)
    for rows in (1, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(linear(x, weight, None, skinny), x @ weight.T, **TOL[torch.float32])
    assert calls == [1, SKINNY_MAX_ROWS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_the_torch_block_boundary(dtype):
    from engine.model.layers import RMSNorm

    gen = torch.Generator().manual_seed(11)
    norm = RMSNorm(100, 1e-6)  # 6 vectors of 16 lanes (or 12 of 8) and a scalar tail of 4
    norm.weight.data = torch.randn(100, generator=gen)
    norm = norm.to(dtype)
    x = torch.randn(5, 100, generator=gen).to(dtype)
    residual = torch.randn(5, 100, generator=gen).to(dtype)
    want_out, want_res = norm.add_norm(x.clone(), residual.clone())  # the torch composition
    got_out, got_res = norm.add_norm(x.clone(), residual.clone(), cpu_ops)
    assert torch.equal(got_res, want_res)  # the add is one rounding in both
    torch.testing.assert_close(got_out.float(), want_out.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_add_rms_norms_formula_without_the_residual(dtype):
    """A stage's first norm and the final norm (RMSNorm.normed with the fused ops): the same
    bits as add_rms_norm_ with a zero residual (one formula for every norm of a fused step and
    of kernels/cpu/greedy_steps.cpp), within rounding of torch's RMSNorm, x left as it was."""
    from engine.model.layers import RMSNorm

    gen = torch.Generator().manual_seed(12)
    norm = RMSNorm(100, 1e-6)  # vectors of 16 (or 8) lanes and a scalar tail of 4
    norm.weight.data = torch.randn(100, generator=gen)
    norm = norm.to(dtype)
    x = torch.randn(5, 100, generator=gen).to(dtype)
    before = x.clone()
    got = norm.normed(x, cpu_ops)
    assert torch.equal(x, before)
    same, _ = norm.add_norm(x.clone(), torch.zeros_like(x), cpu_ops)
    assert torch.equal(got, same)
    torch.testing.assert_close(got.float(), norm(x).float(), **TOL[dtype])
    with pytest.raises(RuntimeError, match="contiguous x"):
        cpu_ops.rms_norm(x.t(), norm.weight, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_matches_apply_rotary(dtype):
    from engine.model.rope import RotaryEmbedding, apply_rotary

    rope = RotaryEmbedding(64, 512, 10000.0, {})
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(7, 6, 64, generator=gen).to(dtype)  # 3 q heads, 1 k head, 2 v heads
    positions = torch.tensor([0, 1, 2, 300, 301, 17, 511])
    want = apply_rotary(rope.lookup(positions, dtype), qkv[:, :4])
    got = qkv.clone()
    cpu_ops.rotary_(got, positions, rope.cos, rope.sin, 4)
    torch.testing.assert_close(got[:, :4].float(), want.float(), **TOL[dtype])
    assert torch.equal(got[:, 4:], qkv[:, 4:])  # values are not rotated
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        cpu_ops.rotary_(got, torch.tensor([0, 1, 2, 3, 4, 5, 512]), rope.cos, rope.sin, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(dtype):
    gen = torch.Generator().manual_seed(2)
    gate_up = (4 * torch.randn(6, 2 * 44, generator=gen)).to(dtype)  # 16-lane, 8-lane and scalar steps
    # The vectorised exp's range ends, and past them: silu is ~x above, ~0 below.
    gate_up[0, :8] = torch.tensor([-1000.0, -100.0, -88.0, -87.0, 87.0, 88.0, 100.0, 1000.0])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_ops.silu_mul(gate_up).float(),
                               (torch.nn.functional.silu(gate) * up).float(), **TOL[dtype])
    with_nan = gate_up.clone()
    with_nan[1, 3] = float("nan")
    assert cpu_ops.silu_mul(with_nan)[1, 3].isnan()  # a NaN stays NaN, never a number


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(12, 4, 64), (8, 8, 32), (8, 2, 128), (4, 2, 80)])
def test_bf16_decodes_over_whole_key_blocks_match_reference(page_size, num_heads, num_kv_heads, head_dim):
    """bf16 decode tokens over whole pages of 16 or 32 keys and ragged last pages (the decode
    path's 8-key blocks and its key-by-key tail): the oracle's result, and no further from fp32
    on the same inputs than bf16 rounding of the output. Group sizes 3, 1, 4 and 2 rows per KV
    head; head_dim 80 is no multiple of 32."""
    gen = torch.Generator().manual_seed(head_dim + page_size)
    ctx_lens = [1, 15, 16, 17, 33, 200, 531]
    query, k_cache, v_cache, table, starts, lens = _paged_batch(
        [1] * len(ctx_lens), ctx_lens, page_size, num_heads, num_kv_heads, head_dim, torch.bfloat16, gen)
    scale = head_dim**-0.5
    got = cpu_ops.paged_attention(query, k_cache, v_cache, table, starts, lens, scale)
    want = _oracle(query, k_cache, v_cache, table, starts, lens, len(ctx_lens), scale)
    torch.testing.assert_close(got.float(), want.float(), **TOL[torch.bfloat16])
    exact = _oracle(query.float(), k_cache.float(), v_cache.float(), table, starts, lens, len(ctx_lens), scale)
    assert (got.float() - exact).abs().max() < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_only_entry_matches_reference(dtype):
    """cpu_ops.paged_decode_attention: the decodes of a step whose prefill chunks go to SDPA."""
    gen = torch.Generator().manual_seed(7)
    query, k_cache, v_cache, table, _, lens = _paged_batch([1, 1, 1], [1, 40, 77], 16, 12, 4, 64, dtype, gen)
    got = cpu_ops.paged_decode_attention(query, k_cache, v_cache, table, lens, 0.125)
    want = reference.paged_decode_attention(query, k_cache, v_cache, table, lens, 0.125)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_cpu_backend_sends_prefill_to_sdpa_only_where_amx_is_not_its_own():
    """bf16 prefill chunks go to SDPA only on an AMX CPU whose compiled kernel cannot use the
    tiles itself (kernels/cpu/prefill_tile_amx.h); everywhere else the whole step is one call."""
    from engine.model.attention import AttentionBackend

    backend = AttentionBackend("cpu")
    amx_elsewhere = torch.cpu._is_amx_tile_supported() and not cpu_ops.amx_attention_supported()
    assert backend.sdpa_prefill_dtypes == ((torch.bfloat16,) if amx_elsewhere else ())
    assert backend.paged_decode_attention is cpu_ops.paged_decode_attention
    assert backend.paged_prefill_attention is reference.paged_prefill_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_items_of_all_kv_heads_and_of_one_give_the_same_bits(dtype):
    """With tiles enough per thread an item takes every KV head of its tile in turn; with few,
    one head each. The same arithmetic either way: equal bits, and equal to the oracle."""
    gen = torch.Generator().manual_seed(11)
    q_lens = [1] * 20 + [40]  # 20 decodes and a chunk of 3 tiles: 23 tiles
    ctx_lens = [5 + 9 * i for i in range(20)] + [90]
    query, k_cache, v_cache, table, starts, lens = _paged_batch(q_lens, ctx_lens, 16, 12, 4, 64, dtype, gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # 23 tiles >= 8 per thread: items of all KV heads
        whole = cpu_ops.paged_attention(query, k_cache, v_cache, table, starts, lens, 0.125)
        torch.set_num_threads(4)  # 23 < 32: an item per KV head
        per_head = cpu_ops.paged_attention(query, k_cache, v_cache, table, starts, lens, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole, per_head)
    want = _oracle(query, k_cache, v_cache, table, starts, lens, 20, 0.125)
    torch.testing.assert_close(whole.float(), want.float(), **TOL[dtype])


def _gemv_or_skip(weight: torch.Tensor):
    from kernels import packed_linear

    packed = packed_linear.pack(weight)
    gemv = packed_linear.gemv_for(packed, weight)
    if gemv is None:
        pytest.skip("no packed GEMV here: no AVX512-BF16, or oneDNN packs bf16 in another layout on this CPU")
    return packed, gemv


@pytest.mark.parametrize("shape", [(256, 64), (96, 128), (32, 2048), (128, 96), (64, 2048)])
def test_packed_gemv_reads_onednns_layout_in_place(shape):
    """kernels/cpu/packed_gemv.cpp on the bytes oneDNN packed: F.linear's result within bf16
    rounding, for every row count it serves, with and without a bias."""
    gen = torch.Generator().manual_seed(shape[0])
    weight = torch.randn(shape, generator=gen).to(torch.bfloat16)
    _, gemv = _gemv_or_skip(weight)
    from kernels import packed_linear

    # Every row count up to 8 (the register kernel), up to 64 (in row groups without AMX, every
    # group size 1-6 among them) or 32 (on AMX tiles: one A tile or two); and for weights it takes
    # prefill rows of on AMX (no more outputs than inputs), 32-row blocks with a ragged last
    # one, across 128-row chunks.
    prefill = (33, 100, 129, 300) if gemv.block_n == 32 and gemv.max_rows > packed_linear.AMX_GEMM_ROWS else ()
    for rows in sorted({*range(1, 14), 15, 16, 17, 25, 31, 32, 33, 47, gemv.max_rows, *prefill}):
        x = torch.randn(rows, shape[1], generator=gen).to(torch.bfloat16)
        for bias in (None, torch.randn(shape[0], generator=gen).to(torch.bfloat16)):
            want = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
            got = gemv(x, bias)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, shape[0])
            torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    if gemv.block_n == 64:  # the vector kernels: a fixed most rows
        assert gemv.max_rows == 64
        with pytest.raises(RuntimeError, match="serves 1 to 64 rows here without AMX"):
            gemv(torch.zeros(65, shape[1], dtype=torch.bfloat16), None)
    else:
        assert gemv.max_rows == (packed_linear.AMX_PREFILL_ROWS if shape[0] <= shape[1] else 32)


def test_packed_gemv_row_groups_give_the_register_kernels_bits():
    """Past 8 rows the kernel multiplies in row groups and chunks of K, but each output adds its
    input pairs in the same order: a row's result is bit-identical whichever kernel took it."""
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(128, 2048, generator=gen).to(torch.bfloat16)
    _, gemv = _gemv_or_skip(weight)
    if gemv.max_rows <= 8:
        pytest.skip("no row-group kernel for this layout here")
    x = torch.randn(gemv.max_rows, 2048, generator=gen).to(torch.bfloat16)
    bias = torch.randn(128, generator=gen).to(torch.bfloat16)
    alone = torch.cat([gemv(x[r:r + 1], bias) for r in range(x.shape[0])])
    for rows in (9, 20, 33, gemv.max_rows):
        assert torch.equal(gemv(x[:rows], bias), alone[:rows])


def test_packed_gemv_is_refused_where_it_would_be_wrong():
    from kernels import packed_linear

    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 64, generator=gen).to(torch.bfloat16)
    packed, _ = _gemv_or_skip(weight)
    other = torch.randn(64, 64, generator=gen).to(torch.bfloat16)
    assert packed_linear.gemv_for(packed, other) is None  # the probe sees the bytes are not this weight's
    assert packed_linear.gemv_for(packed_linear.pack(weight[:, :48].contiguous()), weight[:, :48]) is None  # K % 32
    assert packed_linear.gemv_for(packed_linear.pack(weight.float()), weight.float()) is None  # bf16 only


def _count_gemv_rows(layer) -> list[int]:
    """Wraps the layer's packed GEMV: the returned list gets the row count of each call it takes."""
    real, calls = layer.gemv, []

    class Spy:
        max_rows = real.max_rows

        def __call__(self, x, bias):
            calls.append(x.shape[0])
            return real(x, bias)

    layer.gemv = Spy()
    return calls


def test_engine_linear_takes_the_packed_gemv_up_to_its_layouts_rows():
    """Up to 32 rows on AMX tiles, 64 where oneDNN packs for AVX512-BF16 alone, one row on the
    AMX layout without AMX tiles (kernels/packed_linear.py max_rows); oneDNN multiplies the rest."""
    from engine.model.layers import ColumnParallelLinear, ParallelContext, linear, pack_weight
    from kernels import packed_linear

    layer = ColumnParallelLinear(64, [128], False, ParallelContext()).to(torch.bfloat16)
    layer.weight.data.copy_(torch.randn(128, 64, generator=torch.Generator().manual_seed(4)))
    _gemv_or_skip(layer.weight.data)
    plain = layer.weight.data.clone()
    assert pack_weight(layer) and layer.gemv is not None
    real = layer.gemv
    assert real.max_rows == packed_linear.max_rows(real.block_n, real.block_k, 128, 64) in (
        1, packed_linear.AMX_GEMM_ROWS, packed_linear.GEMV_MAX_ROWS[64])
    calls = _count_gemv_rows(layer)
    row_counts = (1, 2, 5, 8, 9, 32, 33, 64, 65)
    for rows in row_counts:
        x = torch.randn(rows, 64).to(torch.bfloat16)
        want = torch.nn.functional.linear(x.float(), plain.float())
        torch.testing.assert_close(layer(x).float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    assert calls == [r for r in row_counts if r <= real.max_rows]
    assert linear(torch.randn(1, 64).to(torch.bfloat16), layer.weight, None, None, None).shape == (1, 128)


def test_prefill_rows_of_a_narrow_weight_take_the_amx_kernel_up_to_its_limit():
    """On AMX tiles, a weight with no more outputs than inputs (o, down) is multiplied by the
    tile kernel up to AMX_PREFILL_ROWS rows, oneDNN's result up to the order of fp32 partial sums;
    oneDNN past that."""
    from engine.model.layers import ColumnParallelLinear, ParallelContext, pack_weight
    from kernels import cpu_ops, packed_linear

    layer = ColumnParallelLinear(128, [64], False, ParallelContext()).to(torch.bfloat16)
    layer.weight.data.copy_(torch.randn(64, 128, generator=torch.Generator().manual_seed(6)))
    _gemv_or_skip(layer.weight.data)
    assert pack_weight(layer) and layer.gemv is not None
    if not cpu_ops.packed_gemv_amx_supported():
        pytest.skip("no AMX tiles here: prefill rows stay with oneDNN")
    real = layer.gemv
    assert real.max_rows == packed_linear.AMX_PREFILL_ROWS
    calls = _count_gemv_rows(layer)
    gen = torch.Generator().manual_seed(7)
    for rows in (33, 517, real.max_rows, real.max_rows + 1):
        x = torch.randn(rows, 128, generator=gen).to(torch.bfloat16)
        want = packed_linear.apply(x, layer.weight, None).float()
        torch.testing.assert_close(layer(x).float(), want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))
    assert calls == [33, 517, real.max_rows]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decodes_sharing_prefix_pages_match_their_own_copies(dtype):
    """Decodes whose sequences share their first pages (a cached prefix) are attended one after
    another (the kernel groups them by first page); the output is the oracle's, and bit for bit
    what each sequence gets with a private copy of the prefix pages."""
    gen = torch.Generator().manual_seed(12)
    page, prefix_pages, sharers = 16, 3, [0, 2, 3, 5, 6, 8, 9, 11, 12, 14, 15, 17]  # 6 of 18 own their prefix
    ctx_lens = [prefix_pages * page + 1 + 5 * b for b in range(18)]
    q_lens = [1] * 18 + [20]
    query, k_cache, v_cache, table, starts, lens = _paged_batch(q_lens, ctx_lens + [30], page, 12, 4, 64, dtype, gen)
    shared = table.clone()
    for b in sharers:  # two prefixes, each shared by 6 sequences
        owner = 1 if b % 2 == 0 else 4
        shared[b, :prefix_pages] = table[owner, :prefix_pages]
    private_k, private_v = k_cache.clone(), v_cache.clone()
    for b in sharers:  # the private copies: each sharer's own pages hold the shared prefix
        owner = 1 if b % 2 == 0 else 4
        for p in range(prefix_pages):
            private_k[table[b, p]] = k_cache[table[owner, p]]
            private_v[table[b, p]] = v_cache[table[owner, p]]
    got = cpu_ops.paged_attention(query, k_cache, v_cache, shared, starts, lens, 0.125)
    own = cpu_ops.paged_attention(query, private_k, private_v, table, starts, lens, 0.125)
    assert torch.equal(got, own)
    want = _oracle(query, k_cache, v_cache, shared, starts, lens, 18, 0.125)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decodes_sharing_a_long_prefix_are_attended_as_one_group(dtype):
    """Decodes sharing 64 or more keys of whole pages take the group path in bf16 on AVX512-BF16
    or AMX (kernels/cpu/shared_prefix.h: the prefix once for all sharers, then each tail merged
    in) and the decode path elsewhere; both give the oracle's output. The groups here: 5 sharers of
    6 pages, one of them ending exactly where the prefix does (no tail of its own); 3 sharers
    whose tables agree on only 4 of the 6 pages one of them shares with the others' owner; a
    pair sharing 3 pages (48 keys: too few, decode path); a prefill chunk in the same call."""
    gen = torch.Generator().manual_seed(21)
    page = 16
    ctx_lens = [6 * page, 6 * page + 1, 6 * page + 37, 6 * page + 90, 6 * page + 15,  # group A (owner 0)
                6 * page + 20, 6 * page + 3, 4 * page + 40,                         # group B (owner 5)
                3 * page + 9, 3 * page + 30]                                         # too short a prefix
    num_decode = len(ctx_lens)
    q_lens = [1] * num_decode + [40]
    query, k_cache, v_cache, table, starts, lens = _paged_batch(
        q_lens, ctx_lens + [6 * page + 50], page, 12, 4, 64, dtype, gen)
    private_k, private_v = k_cache.clone(), v_cache.clone()
    shared = table.clone()
    for b, owner, pages in [(1, 0, 6), (2, 0, 6), (3, 0, 6), (4, 0, 6), (6, 5, 6), (7, 5, 4), (9, 8, 3)]:
        shared[b, :pages] = table[owner, :pages]
        for p in range(pages):  # the private copies: the same keys and values in the sharer's own pages
            private_k[table[b, p]] = k_cache[table[owner, p]]
            private_v[table[b, p]] = v_cache[table[owner, p]]
    got = cpu_ops.paged_attention(query, k_cache, v_cache, shared, starts, lens, 0.125)
    want = _oracle(query, k_cache, v_cache, shared, starts, lens, num_decode, 0.125)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    own = cpu_ops.paged_attention(query, private_k, private_v, table, starts, lens, 0.125)
    torch.testing.assert_close(own.float(), want.float(), **TOL[dtype])
    grouped = dtype == torch.bfloat16 and cpu_ops.shared_prefix_attention_supported()
    # The group path rounds the prefix's softmax weights to bf16 where the decode path keeps fp32,
    # so its sharers' outputs differ from their private copies' in the last bits; nothing else does.
    differs = (got != own).flatten(1).any(1)
    assert differs[:8].any().item() == grouped
    assert not differs[8:].any()


@pytest.mark.parametrize("first_len", [64, 95, 111, 126, 300])
def test_a_verifications_rows_are_attended_as_plain_decoding_attends_each(first_len):
    """A speculating sequence's 1 + k rows are decode entries over the same pages
    (engine/model_runner.py); however long the context, and where the rows cross a page
    boundary too, they never form a shared-prefix group among themselves (whose bf16 rounding
    of the softmax weights differs from the decode path's), so each row is bit for bit what
    attending it alone gives. A second sequence sharing the prefix still makes a group with
    them. Before, a verification across a page boundary at 64 keys or more took the group path,
    and greedy speculation left plain greedy on stdlib prompts at 256 output tokens."""
    gen = torch.Generator().manual_seed(first_len)
    page, rows = 16, 5
    lens = list(range(first_len, first_len + rows))
    query, k_cache, v_cache, table, _, _ = _paged_batch([1] * rows, [lens[-1]] * rows, page, 6, 2, 64,
                                                        torch.bfloat16, gen)
    same = table[:1].repeat(rows, 1)  # one sequence's table on every row
    starts = torch.arange(rows + 1, dtype=torch.int32)
    got = cpu_ops.paged_attention(query, k_cache, v_cache, same, starts, torch.tensor(lens, dtype=torch.int32), 0.125)
    for j, n in enumerate(lens):
        alone = cpu_ops.paged_attention(query[j:j + 1], k_cache, v_cache, same[:1], starts[:2],
                                        torch.tensor([n], dtype=torch.int32), 0.125)
        assert torch.equal(got[j], alone[0]), (first_len, j)
    if not cpu_ops.shared_prefix_attention_supported():
        return
    # Another sequence over the same full first pages, its next token in a page of its own: a group.
    # (Not the page the verification's first row writes its token into: that one is its own.)
    shared_pages = (first_len - 1) // page
    if shared_pages * page < 64:  # too short a prefix for a group (paged_attention.cpp kMinSharedKeys)
        return
    other = table[1:2].clone()
    other[0, :shared_pages] = table[0, :shared_pages]
    with_other = cpu_ops.paged_attention(
        torch.cat([query, query[:1]]), k_cache, v_cache, torch.cat([same, other]),
        torch.arange(rows + 2, dtype=torch.int32), torch.tensor(lens + [first_len + 1], dtype=torch.int32), 0.125)
    assert not torch.equal(with_other[:rows], got)  # grouped: the group path's rounding


def test_a_build_lock_left_by_a_killed_build_is_removed_not_waited_on(tmp_path):
    """torch's `lock` file outlives a build killed mid-way, and every later load would wait on it
    forever; under cpu_ops' own flock (which dies with its holder) it is known stale and removed.
    A build still running holds the flock, so its lock is left alone (the guard waits instead)."""
    import fcntl
    import subprocess
    import sys

    (tmp_path / "lock").write_text("")  # what `kill -9` of a building process leaves
    with cpu_ops._build_guard(tmp_path):
        assert not (tmp_path / "lock").exists()
    # Another process holds the guard (a live build): a non-blocking take fails, nothing is removed.
    (tmp_path / "lock").write_text("")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True);"
        " time.sleep(30)"), str(tmp_path / "pdserve-build.flock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with open(tmp_path / "pdserve-build.flock", "a+") as f, pytest.raises(BlockingIOError):
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert (tmp_path / "lock").exists()
    finally:
        holder.kill()
        holder.wait()
    with cpu_ops._build_guard(tmp_path):  # the holder died: its flock went with it
        assert not (tmp_path / "lock").exists()
