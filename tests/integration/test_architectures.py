"""Other checkpoint families through the same loader: randomly initialised Qwen2 (qkv bias),
untied Llama with llama3 rope scaling and an explicit head_dim, and Mistral, each written by
transformers' own save_pretrained and compared with its own generate()."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers import assert_no_page_leak, hf_greedy

COMMON = dict(vocab_size=4096, hidden_size=128, intermediate_size=320, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
              initializer_range=0.2, bos_token_id=0, eos_token_id=1)


def make_checkpoint(kind: str, out, tiny_dir):
    import transformers as tf

    torch.manual_seed(0)
    if kind == "qwen2":
        cfg = tf.Qwen2Config(**COMMON, tie_word_embeddings=True, use_sliding_window=False)
        model = tf.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # HF initialises biases to zero, which would leave them untested
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif kind == "llama-untied-llama3-rope":
        cfg = tf.LlamaConfig(**COMMON, tie_word_embeddings=False, head_dim=48,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64})
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "llama-attention-bias":
        cfg = tf.LlamaConfig(**COMMON, tie_word_embeddings=True, attention_bias=True)
        model = tf.LlamaForCausalLM(cfg)
        with torch.no_grad():  # q, k, v and o all carry a bias here
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                             layer.self_attn.o_proj):
                    proj.bias.normal_(0, 0.5)
    else:
        cfg = tf.MistralConfig(**COMMON, tie_word_embeddings=False, sliding_window=None)
        model = tf.MistralForCausalLM(cfg)
    model.save_pretrained(out)
    for f in ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]:
        shutil.copy(tiny_dir / f, out / f)
    return model.eval()


@pytest.mark.parametrize("kind", ["qwen2", "llama-untied-llama3-rope", "llama-attention-bias", "mistral"])
def test_family_matches_hf(kind, tmp_path, tiny_dir):
    hf = make_checkpoint(kind, tmp_path, tiny_dir)
    llm = LLM(str(tmp_path), page_size=8, max_num_batched_tokens=64)
    if kind == "qwen2":
        assert llm.engine.model_config.qkv_bias
        loaded = llm.engine.model.layers[0].self_attn.qkv_proj.bias
        assert torch.equal(loaded[:128], hf.model.layers[0].self_attn.q_proj.bias.detach())
    prompts = [[0] + list(range(5, 5 + n)) for n in (3, 90, 200)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        ref, ref_lp = hf_greedy(hf, prompt, 24)
        assert out.token_ids == ref
        assert out.logprobs == pytest.approx(ref_lp, abs=2e-3)
    assert_no_page_leak(llm.engine)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'"),
        ({"mlp_bias": True}, "mlp_bias=true is not implemented"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not implemented"),
        ({"rope_scaling": {"rope_type": "longrope"}}, "rope_scaling type 'longrope' is not implemented"),
        ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling 'linear' lacks the key 'factor'"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_unsupported_checkpoints_fail_at_load_naming_why(tmp_path, tiny_dir, change, message):
    import json

    for f in tiny_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(change)
    if cfg["hidden_size"] is None:
        del cfg["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path))


def test_wrong_tensor_shape_is_named(tmp_path, tiny_dir):
    from safetensors.torch import load_file, save_file

    for f in tiny_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight"] = tensors["model.layers.0.mlp.down_proj.weight"][:, :-1].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"checkpoint weight has shape \(256, 703\), expected \(256, 704\)"):
        LLM(str(tmp_path))


def test_model_builds_on_any_default_device():
    # Built under the meta device, nothing may land on the CPU: on CUDA the same code path puts
    # the rope tables and the untied lm_head on the GPU.
    from engine.model.attention import AttentionBackend
    from engine.model.config import ModelConfig
    from engine.model.llama import LlamaForCausalLM

    cfg = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **COMMON, "tie_word_embeddings": False})
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, AttentionBackend("torch"))
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert model.rope.cos.device.type == "meta" and model.lm_head.weight.device.type == "meta"


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLM(str(tmp_path))
