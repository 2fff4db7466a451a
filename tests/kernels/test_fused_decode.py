"""engine/model/fused_decode.py: a step's layers in one compiled call (kernels/cpu/decode_layers.cpp)
against the Python loop over the same layers, bit for bit, in a running engine."""

import pytest
import torch
from torch import nn

from engine import LLM, SamplingParams
from engine.model.fused_decode import FusedDecodeLayers
from kernels import cpu_ops

if cpu_ops.load() is None:
    pytest.skip(f"CPU extension unavailable: {cpu_ops.load_error()}", allow_module_level=True)


def _llm(**kwargs) -> LLM:
    llm = LLM("builtin:tiny", dtype="bfloat16", page_size=16, max_num_batched_tokens=256, max_num_seqs=16,
              kv_cache_memory_bytes=4 << 20, enable_prefix_caching=False, **kwargs)
    if llm.engine.model.fused_decode is None:
        pytest.skip("no packed GEMV on this CPU (it needs AVX512-BF16): the layers stay in Python")
    return llm


def _check_both_paths(llm: LLM, monkeypatch) -> list[int]:
    """Every forward of the engine runs twice from the same KV cache, fused and in Python; both
    outputs and the caches they leave must be equal. Returns the rows of each fused call."""
    model, kv = llm.engine.model, llm.engine.kv_cache
    caches = [t for i in range(len(model.layers)) for t in kv.layer(model.layers[i].self_attn.layer_id)]
    fused_rows: list[int] = []
    real_call, real_stage = FusedDecodeLayers.__call__, model.forward_stage

    def counted(self, hidden, *args):
        fused_rows.append(hidden.shape[0])
        return real_call(self, hidden, *args)

    def both(batch, kv_cache, hidden=None):
        before = [t.clone() for t in caches]
        fused_out = real_stage(batch, kv_cache, hidden)
        fused_caches = [t.clone() for t in caches]
        for t, saved in zip(caches, before):
            t.copy_(saved)
        fused, model.fused_decode = model.fused_decode, None
        try:
            python_out = real_stage(batch, kv_cache, hidden)
        finally:
            model.fused_decode = fused
        assert torch.equal(fused_out, python_out)
        assert all(torch.equal(a, b) for a, b in zip(fused_caches, caches))
        return fused_out

    monkeypatch.setattr(FusedDecodeLayers, "__call__", counted)
    monkeypatch.setattr(model, "forward_stage", both)
    return fused_rows


@pytest.mark.parametrize("biases", [False, True])
def test_fused_layers_give_the_python_loops_bits(biases, monkeypatch):
    """Decode steps, a step mixing decodes with a short prompt's prefill, and (with `biases`) a
    qkv bias inside the product and an o bias after it, as Qwen2-style checkpoints have."""
    llm = _llm()
    model = llm.engine.model
    if biases:
        gen = torch.Generator().manual_seed(3)
        for layer in model.layers:
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj):
                out = lin.gemv.out_features
                lin.bias = nn.Parameter((torch.randn(out, generator=gen) * 0.5).to(torch.bfloat16), requires_grad=False)
        model.fused_decode = FusedDecodeLayers.build(model)
    fused_rows = _check_both_paths(llm, monkeypatch)
    eng = llm.engine
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for i, n in enumerate((40, 70)):
        eng.add_request(f"long{i}", [(7 * i + 11 * j) % 4000 + 10 for j in range(n)], params)
    for _ in range(3):  # the two prompts' prefill, then decodes of both
        eng.step()
    eng.add_request("short", [5, 6, 7], params)  # its prefill rides along the two decodes
    finished = []
    while eng.has_unfinished_requests():
        finished += [o.request_id for o in eng.step() if o.finished]
    assert sorted(finished) == ["long0", "long1", "short"]
    assert 2 in fused_rows  # decodes of the two long prompts
    assert 2 + 3 in fused_rows  # the step that mixed them with the short prompt's prefill
    assert max(fused_rows) <= model.fused_decode.max_rows


def test_steps_past_the_gemvs_rows_stay_in_python(monkeypatch):
    """A prefill chunk of more rows than the packed GEMV takes goes to oneDNN, so the loop stays
    in Python; the decodes after it are fused."""
    llm = _llm()
    fused = llm.engine.model.fused_decode
    fused_rows = _check_both_paths(llm, monkeypatch)
    prompt = list(range(10, 10 + fused.max_rows + 5))
    llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
    assert fused_rows == [1, 1, 1]  # the first token comes from the prefill, unfused


def test_fused_decode_is_built_only_where_it_serves():
    """The torch backend, and a model whose weights are not packed, keep the Python loop."""
    torch_llm = LLM("builtin:tiny", dtype="bfloat16", kv_cache_memory_bytes=4 << 20, attention_backend="torch")
    assert torch_llm.engine.model.fused_decode is None
    llm = _llm()
    model = llm.engine.model
    model.layers[1].mlp.down_proj.gemv = None
    assert FusedDecodeLayers.build(model) is None
