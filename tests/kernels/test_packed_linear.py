"""Linear layers multiplied by weights packed once for oneDNN (kernels/packed_linear.py), the
CPU serving path, against F.linear; and the engine's model carrying them after load."""

import pytest
import torch
import torch.nn.functional as F

from configs import EngineConfig
from engine import LLMEngine
from engine.model.layers import ColumnParallelLinear, ParallelContext, linear, pack_weight
from kernels import packed_linear

if not packed_linear.available():
    pytest.skip("this torch has no oneDNN", allow_module_level=True)

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, 600])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, dtype, bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype) if bias else None
    # A strided activation, as a slice of a wider buffer is.
    x = torch.randn(rows, 100, generator=gen).to(dtype)[:, 10:90]
    packed = packed_linear.pack(weight)
    if packed is None and dtype == torch.bfloat16 and not _onednn_packs_bf16():
        # oneDNN packs bf16 only with AVX512-BW/VL/DQ or AVX-NE-CONVERT (an AVX2-only Zen 3 has
        # neither): pack declines and the layer keeps its plain weight and F.linear.
        packed = weight
    else:
        assert packed is not None and packed.is_mkldnn and packed.shape == weight.shape
    got = linear(x, packed, b, skinny=None)
    torch.testing.assert_close(got.float(), F.linear(x, weight, b).float(), **TOL[dtype])


def _onednn_packs_bf16() -> bool:
    """Whether this CPU has what oneDNN's bf16 weight reorder asks for (its error names the flags)."""
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    return "avx_ne_convert" in flags or {"avx512bw", "avx512vl", "avx512dq"} <= set(flags)


def test_pack_declines_what_it_cannot_serve():
    assert packed_linear.pack(torch.zeros(4, 8, dtype=torch.int32)) is None
    assert packed_linear.pack(torch.zeros(4, 8, device="meta")) is None
    assert packed_linear.pack(torch.zeros(2, 4, 8)) is None


def test_a_packed_layer_refuses_a_late_load():
    layer = ColumnParallelLinear(8, [4, 4], bias=False, ctx=ParallelContext())
    layer.weight.data.normal_()
    assert pack_weight(layer)
    with pytest.raises(RuntimeError, match="already packed for serving"):
        layer.load_weight(0, torch.zeros(4, 8))


@pytest.mark.parametrize("backend, packed", [("auto", True), ("torch", False)])
def test_engine_packs_linear_weights_only_on_the_cpu_kernel_path(backend, packed):
    model = LLMEngine(EngineConfig(model="builtin:tiny", attention_backend=backend)).model
    weights = [layer.self_attn.qkv_proj.weight for layer in model.layers] + [model.layers[0].mlp.down_proj.weight]
    assert all(w.is_mkldnn == packed for w in weights)
    # Tied embeddings: the lookup keeps the plain table, the output projection a packed copy.
    assert not model.embed_tokens.weight.is_mkldnn
    assert (model.packed_output is not None) == packed


def _int8_or_skip():
    if not packed_linear.int8_supported():
        pytest.skip("no int8 products here (they need AVX512-VNNI and AVX512-BF16)")


def _quantized_reference(x: torch.Tensor, gemv: packed_linear.PackedGemv, bias: torch.Tensor | None) -> torch.Tensor:
    """What the int8 kernel computes: each row of x quantized to 8 bits (scale max |x| / 127,
    round to nearest even), times the dequantized weight, in float32."""
    scale = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-30) / 127
    q = torch.round(x.float() * (1 / scale)).clamp(-127, 127)
    y = (q @ packed_linear.dequantized_int8(gemv).T) * scale
    return y if bias is None else y + bias.float()


@pytest.mark.parametrize("bias", [False, True])
def test_int8_products_are_the_quantized_maths_and_each_row_its_own(bias):
    """speculative.draft_quantization's products (kernels/cpu/packed_gemv.cpp run_int8): within
    bf16 rounding of the quantized maths, near F.linear (8-bit weights and activations), and each
    row the same bits whatever rows share the call (1, 5 and 13: past one group of 8)."""
    _int8_or_skip()
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(640, 100, generator=gen) * 0.05).bfloat16()  # K = 100: a tail past 6 x 16
    b = torch.randn(640, generator=gen).bfloat16() if bias else None
    gemv = packed_linear.quantize_int8(weight)
    assert gemv is not None and gemv.blocked.dtype == torch.uint8 and gemv.max_rows == 64
    x = torch.randn(13, 100, generator=gen).bfloat16()
    got = gemv(x, b)
    want = _quantized_reference(x, gemv, b)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)
    exact = F.linear(x.float(), weight.float(), None if b is None else b.float())
    assert (got.float() - exact).abs().max() < 0.03 * exact.abs().max()
    for rows in (1, 5):
        assert torch.equal(gemv(x[:rows], b), got[:rows])
    assert all(torch.equal(gemv(x[i:i + 1], b)[0], got[i]) for i in range(13))


def test_int8_quantization_declines_shapes_off_its_blocks_and_the_kernel_checks_its_buffer():
    _int8_or_skip()
    assert packed_linear.quantize_int8(torch.randn(96, 64).bfloat16()) is None  # 96 outputs: not 64s
    assert packed_linear.quantize_int8(torch.randn(64, 66).bfloat16()) is None  # 66 inputs: not 4s
    gemv = packed_linear.quantize_int8(torch.randn(64, 64).bfloat16())
    assert gemv is not None
    from kernels import cpu_ops

    with pytest.raises(RuntimeError, match="holds N x K weights, N scales and N sums"):
        cpu_ops.packed_gemv(torch.randn(1, 64).bfloat16(), gemv.blocked[:-1], 64, None, 64, 4)
    with pytest.raises(RuntimeError, match="int8_gemv takes bf16 x"):
        cpu_ops.packed_gemv(torch.randn(1, 64), gemv.blocked, 64, None, 64, 4)
