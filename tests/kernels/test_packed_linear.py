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
    assert packed is not None and packed.is_mkldnn and packed.shape == weight.shape
    got = linear(x, packed, b, skinny=None)
    torch.testing.assert_close(got.float(), F.linear(x, weight, b).float(), **TOL[dtype])


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
