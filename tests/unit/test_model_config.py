"""ModelConfig.from_hf_dict for the supported families; KV sizing math."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine.kv_cache import KVCache
from engine.model.config import ModelConfig, UnsupportedModelError

LLAMA31 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}

QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "max_window_layers": 21,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
}

MISTRAL = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "vocab_size": 32768,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def cfg(base, **changes):
    d = json.loads(json.dumps(base))
    for key, value in changes.items():
        if value is ...:
            d.pop(key, None)
        else:
            d[key] = value
    return d


def test_llama31():
    c = ModelConfig.from_hf_dict(LLAMA31)
    assert c.architecture == "LlamaForCausalLM"
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (128256, 4096, 14336, 32)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (32, 8, 128)
    assert c.max_position_embeddings == 131072
    assert c.rms_norm_eps == 1e-05
    assert c.rope_theta == 500000.0
    assert c.rope_scaling_dict == LLAMA31["rope_scaling"]
    assert c.tie_word_embeddings is False
    assert c.qkv_bias is False
    assert c.bos_token_id == 128000
    assert c.eos_token_ids == (128001, 128008, 128009)


def test_qwen2_has_qkv_bias_and_gqa():
    c = ModelConfig.from_hf_dict(QWEN2)
    assert c.architecture == "Qwen2ForCausalLM"
    assert c.qkv_bias is True
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (14, 2, 64)
    assert c.tie_word_embeddings is True
    assert c.rope_theta == 1e6
    assert c.rope_scaling == ()
    assert c.rope_scaling_dict == {}
    assert c.eos_token_ids == (151643,)
    assert c.rms_norm_eps == 1e-6


def test_qwen2_sliding_window_enabled_rejected():
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        ModelConfig.from_hf_dict(cfg(QWEN2, use_sliding_window=True))


def test_mistral_full_attention():
    c = ModelConfig.from_hf_dict(MISTRAL)
    assert c.architecture == "MistralForCausalLM"
    assert c.qkv_bias is False
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (32, 8, 128)
    assert c.eos_token_ids == (2,)


def test_mistral_sliding_window_equal_to_context_is_full_attention():
    c = ModelConfig.from_hf_dict(cfg(MISTRAL, sliding_window=32768))
    assert c.max_position_embeddings == 32768


def test_mistral_sliding_window_smaller_than_context_raises():
    with pytest.raises(UnsupportedModelError, match=r"sliding_window=4096"):
        ModelConfig.from_hf_dict(cfg(MISTRAL, sliding_window=4096))


def test_head_dim_explicit_vs_derived():
    # Mistral-Nemo style: explicit head_dim differs from hidden / heads.
    c = ModelConfig.from_hf_dict(cfg(MISTRAL, hidden_size=5120, head_dim=128))
    assert c.head_dim == 128
    assert ModelConfig.from_hf_dict(cfg(MISTRAL, hidden_size=5120, head_dim=...)).head_dim == 160
    assert ModelConfig.from_hf_dict(cfg(MISTRAL, hidden_size=5120, head_dim=None)).head_dim == 160


def test_missing_kv_heads_means_mha():
    c = ModelConfig.from_hf_dict(cfg(LLAMA31, num_key_value_heads=...))
    assert c.num_kv_heads == c.num_heads == 32


def test_kv_heads_must_divide_heads():
    with pytest.raises(UnsupportedModelError, match="num_attention_heads 32"):
        ModelConfig.from_hf_dict(cfg(LLAMA31, num_key_value_heads=5))


def test_eos_variants():
    assert ModelConfig.from_hf_dict(cfg(LLAMA31, eos_token_id=7)).eos_token_ids == (7,)
    assert ModelConfig.from_hf_dict(cfg(LLAMA31, eos_token_id=[7, 9])).eos_token_ids == (7, 9)
    assert ModelConfig.from_hf_dict(cfg(LLAMA31, eos_token_id=None)).eos_token_ids == ()
    assert ModelConfig.from_hf_dict(cfg(LLAMA31, eos_token_id=...)).eos_token_ids == ()
    assert ModelConfig.from_hf_dict(cfg(LLAMA31, eos_token_id=0)).eos_token_ids == (0,)


def test_attention_bias_enables_qkv_bias_for_llama():
    assert ModelConfig.from_hf_dict(cfg(LLAMA31, attention_bias=True)).qkv_bias is True


def test_rope_scaling_captured_and_frozen():
    c = ModelConfig.from_hf_dict(LLAMA31)
    assert isinstance(c.rope_scaling, tuple)
    assert dict(c.rope_scaling)["rope_type"] == "llama3"
    assert dict(c.rope_scaling)["factor"] == 8.0
    # The dict view is a copy: mutating it does not change the config.
    c.rope_scaling_dict["factor"] = 1.0
    assert c.rope_scaling_dict["factor"] == 8.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.rope_theta = 1.0  # type: ignore[misc]


def test_transformers_v5_rope_parameters_block():
    # transformers 5 writes rope_parameters (with rope_theta inside) instead of rope_scaling.
    d = cfg(LLAMA31, rope_theta=..., rope_scaling=...)
    d["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 250000.0}
    c = ModelConfig.from_hf_dict(d)
    assert c.rope_theta == 250000.0
    assert c.rope_scaling_dict == {"rope_type": "linear", "factor": 2.0}


def test_defaults_when_optional_fields_missing():
    d = cfg(LLAMA31, rope_theta=..., rope_scaling=..., max_position_embeddings=..., rms_norm_eps=...,
            tie_word_embeddings=..., bos_token_id=...)
    c = ModelConfig.from_hf_dict(d)
    assert c.rope_theta == 10000.0
    assert c.rope_scaling == ()
    assert c.max_position_embeddings == 2048
    assert c.rms_norm_eps == 1e-6
    assert c.tie_word_embeddings is False
    assert c.bos_token_id is None


@pytest.mark.parametrize("arch", ["GPT2LMHeadModel", "MixtralForCausalLM", "Qwen3ForCausalLM"])
def test_unsupported_architecture_named(arch):
    with pytest.raises(UnsupportedModelError, match=arch) as info:
        ModelConfig.from_hf_dict(cfg(LLAMA31, architectures=[arch]))
    assert "LlamaForCausalLM" in str(info.value)  # lists what is supported
    assert isinstance(info.value, ValueError)


def test_missing_architectures_falls_back_to_model_type_in_error():
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        ModelConfig.from_hf_dict({"model_type": "gpt2", "hidden_size": 8})


def test_from_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN2))
    assert ModelConfig.from_dir(tmp_path) == ModelConfig.from_hf_dict(QWEN2)
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_dir(tmp_path / "nope")


# -- KV sizing --------------------------------------------------------------------------------
def test_kv_bytes_per_token():
    c = ModelConfig.from_hf_dict(LLAMA31)
    # K and V x 32 layers x 8 kv heads x 128 dims x 2 bytes = 128 KiB per token in bf16.
    assert c.kv_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2 == 131072
    assert c.kv_bytes_per_token(4) == 262144
    q = ModelConfig.from_hf_dict(QWEN2)
    assert q.kv_bytes_per_token(2) == 2 * 24 * 2 * 64 * 2


def test_pages_for_budget():
    c = ModelConfig.from_hf_dict(QWEN2)
    per_page_bf16 = c.kv_bytes_per_token(2) * 16
    assert KVCache.pages_for_budget(c, per_page_bf16 * 10, 16, torch.bfloat16) == 10
    assert KVCache.pages_for_budget(c, per_page_bf16 * 10 + per_page_bf16 - 1, 16, torch.bfloat16) == 10
    assert KVCache.pages_for_budget(c, per_page_bf16 * 10, 16, torch.float32) == 5
    assert KVCache.pages_for_budget(c, per_page_bf16 * 10, 16, torch.float16) == 10
    assert KVCache.pages_for_budget(c, per_page_bf16, 16, torch.bfloat16) == 1
    assert isinstance(KVCache.pages_for_budget(c, per_page_bf16 * 3, 16, torch.bfloat16), int)


def test_pages_for_budget_too_small():
    c = ModelConfig.from_hf_dict(QWEN2)
    per_page = c.kv_bytes_per_token(4) * 16
    with pytest.raises(ValueError, match=rf"kv_cache_memory_bytes={per_page - 1} holds no page") as info:
        KVCache.pages_for_budget(c, per_page - 1, 16, torch.float32)
    assert str(per_page) in str(info.value)


def test_kv_cache_shapes_and_bytes():
    tiny = cfg(LLAMA31, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    c = ModelConfig.from_hf_dict(tiny)
    kv = KVCache(c, num_pages=5, page_size=4, dtype=torch.float32, device="cpu")
    assert len(kv.k) == len(kv.v) == 3
    k, v = kv.layer(1)
    assert k.shape == v.shape == (5, 4, 2, 16)
    assert kv.num_bytes == c.kv_bytes_per_token(4) * 4 * 5
    assert KVCache.pages_for_budget(c, kv.num_bytes, 4, torch.float32) == 5
