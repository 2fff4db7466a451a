"""engine.model.rope.RotaryEmbedding against Hugging Face's LlamaRotaryEmbedding, per rope type."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

import engine.model.rope as rope_module
from engine.model.config import ModelConfig, UnsupportedModelError
from engine.model.rope import RotaryEmbedding

# (id, head_dim, max_position_embeddings, rope_parameters incl. rope_type and rope_theta)
CASES = [
    ("default-64", 64, 4096, {"rope_type": "default", "rope_theta": 10000.0}),
    ("default-128-1e6", 128, 8192, {"rope_type": "default", "rope_theta": 1_000_000.0}),
    ("linear-2", 64, 8192, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    ("linear-4", 128, 16384, {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0}),
    ("llama3.1", 128, 32768, {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    }),
    ("llama3.2", 64, 16384, {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    }),
    ("llama3-small-context", 64, 4096, {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 2.0,
        "high_freq_factor": 8.0, "original_max_position_embeddings": 512,
    }),
    ("yarn-qwen", 128, 32768, {
        "rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 4.0, "original_max_position_embeddings": 8192,
    }),
    ("yarn-betas", 64, 16384, {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 2048,
        "beta_fast": 16, "beta_slow": 2,
    }),
    ("yarn-mscale", 64, 16384, {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4096,
        "mscale": 1.0, "mscale_all_dim": 0.5,
    }),
    ("yarn-attention-factor", 64, 8192, {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 4096,
        "attention_factor": 1.25,
    }),
    ("yarn-factor-from-context", 64, 8192, {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": None, "original_max_position_embeddings": 2048,
    }),
    ("yarn-no-truncate", 64, 8192, {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 4096,
        "truncate": False,
    }),
]


def hf_cos_sin(head_dim, max_pos, rope_parameters, positions):
    config = LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=4, head_dim=head_dim,
        max_position_embeddings=max_pos, rope_parameters=dict(rope_parameters),
    )
    assert config.rope_parameters["rope_type"] == rope_parameters["rope_type"]
    rotary = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, positions[None])
    return cos[0], sin[0]


def positions_for(max_pos):
    # The first 256 positions, then a spread up to the last one (large positions are where the
    # scaled frequencies matter).
    spread = torch.linspace(256, max_pos - 1, 256).long()
    return torch.cat([torch.arange(256), spread, torch.tensor([max_pos - 1])])


def engine_apply(rope, positions, q, k):
    """Rotates q/k with the engine's code. The application API is being reworked concurrently:
    `lookup` + `apply_rotary(cos_sin, x)` / `apply_rotary(cos_sin, q, k)`, or the older `apply`."""
    fn = getattr(rope_module, "apply_rotary", None)
    if fn is None:
        return rope.apply(positions, q, k)
    cos_sin = rope.lookup(positions, q.dtype)
    if len(inspect.signature(fn).parameters) == 2:
        return fn(cos_sin, q), fn(cos_sin, k)
    return fn(cos_sin, q, k)


def ours(head_dim, max_pos, rope_parameters):
    scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    return RotaryEmbedding(head_dim, max_pos, rope_parameters["rope_theta"], scaling)


@pytest.mark.parametrize(("head_dim", "max_pos", "params"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_cos_sin_match_hf(head_dim, max_pos, params):
    rope = ours(head_dim, max_pos, params)
    assert rope.cos.shape == rope.sin.shape == (max_pos, head_dim)
    assert rope.cos.dtype == torch.float32
    pos = positions_for(max_pos)
    cos, sin = hf_cos_sin(head_dim, max_pos, params, pos)
    torch.testing.assert_close(rope.cos[pos], cos, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rope.sin[pos], sin, rtol=1e-6, atol=1e-6)


def test_scaled_types_actually_differ_from_default():
    # Guard against a comparison that would pass trivially: each scaling changes the tables.
    base = RotaryEmbedding(128, 4096, 500000.0, {})
    for name, head_dim, _, params in CASES:
        if name in ("linear-4", "llama3.1"):
            scaled = ours(head_dim, 4096, params)
            assert not torch.allclose(scaled.cos, base.cos)
            torch.testing.assert_close(scaled.cos[0], base.cos[0])  # position 0 is never rotated
    r = ours(128, 4096, CASES[7][3])  # yarn: cos/sin scaled by the attention factor
    assert r.cos[0, 0].item() == pytest.approx(0.1 * math.log(4.0) + 1.0, rel=1e-6)


@pytest.mark.parametrize("rope_scaling", [
    None,
    {"type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 2048},
    {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
], ids=["none", "linear", "llama3", "yarn"])
def test_legacy_config_json_through_model_config(rope_scaling):
    # A pre-v5 config.json (top-level rope_theta + rope_scaling), parsed by ModelConfig, gives the
    # same tables as Hugging Face loading the same dict.
    d = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 256, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 16384, "rope_theta": 500000.0, "rope_scaling": rope_scaling,
    }
    mc = ModelConfig.from_hf_dict(d)
    rope = RotaryEmbedding(mc.head_dim, mc.max_position_embeddings, mc.rope_theta, mc.rope_scaling_dict)
    rotary = LlamaRotaryEmbedding(LlamaConfig(**d))
    pos = positions_for(16384)
    cos, sin = rotary(torch.zeros(1), pos[None])
    torch.testing.assert_close(rope.cos[pos], cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rope.sin[pos], sin[0], rtol=1e-6, atol=1e-6)


def test_legacy_type_key_same_as_rope_type():
    a = RotaryEmbedding(64, 2048, 10000.0, {"type": "linear", "factor": 2.0})
    b = RotaryEmbedding(64, 2048, 10000.0, {"rope_type": "linear", "factor": 2.0})
    c = RotaryEmbedding(64, 2048, 10000.0, {})
    assert torch.equal(a.cos, b.cos) and torch.equal(a.sin, b.sin)
    assert not torch.equal(a.cos, c.cos)


def test_empty_scaling_is_default():
    pos = positions_for(2048)
    cos, sin = hf_cos_sin(64, 2048, {"rope_type": "default", "rope_theta": 10000.0}, pos)
    rope = RotaryEmbedding(64, 2048, 10000.0, {})
    torch.testing.assert_close(rope.cos[pos], cos, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rope.sin[pos], sin, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("idx", [0, 4, 7])
def test_apply_matches_hf_apply_rotary_pos_emb(idx):
    name, head_dim, max_pos, params = CASES[idx]
    rope = ours(head_dim, max_pos, params)
    g = torch.Generator().manual_seed(idx)
    positions = torch.tensor([0, 1, 5, 17, 1000, max_pos - 1])
    q = torch.randn(len(positions), 4, head_dim, generator=g)
    k = torch.randn(len(positions), 2, head_dim, generator=g)
    q_out, k_out = engine_apply(rope, positions, q, k)
    cos, sin = hf_cos_sin(head_dim, max_pos, params, positions)
    # HF layout: [batch, heads, seq, dim] with cos/sin [batch, seq, dim].
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    torch.testing.assert_close(q_out, q_hf[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_out, k_hf[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_apply_position_zero_is_identity_and_norm_preserved():
    rope = RotaryEmbedding(64, 512, 10000.0, {})
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 64, generator=g)
    k = torch.randn(3, 1, 64, generator=g)
    q_out, k_out = engine_apply(rope, torch.tensor([0, 10, 300]), q, k)
    torch.testing.assert_close(q_out[0], q[0])
    torch.testing.assert_close(k_out[0], k[0])
    torch.testing.assert_close(q_out.norm(dim=-1), q.norm(dim=-1))
    assert not torch.allclose(q_out[1], q[1])


@pytest.mark.parametrize("rope_type", ["longrope", "foo", "dynamic"])
def test_unknown_rope_type_raises(rope_type):
    with pytest.raises(UnsupportedModelError, match=rope_type):
        RotaryEmbedding(64, 128, 10000.0, {"rope_type": rope_type, "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match=rope_type):
        RotaryEmbedding(64, 128, 10000.0, {"type": rope_type, "factor": 2.0})
