"""Other checkpoint families through the same loader: randomly initialised Qwen2 (qkv bias),
untied Llama with llama3 rope scaling and an explicit head_dim, and Mistral, each written by
transformers' own save_pretrained and compared with its own generate()."""

from __future__ import annotations

import shutil

import pytest
import torch
from tests.helpers import assert_no_page_leak, hf_greedy

from engine import LLM, SamplingParams

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
    else:
        cfg = tf.MistralConfig(**COMMON, tie_word_embeddings=False, sliding_window=None)
        model = tf.MistralForCausalLM(cfg)
    model.save_pretrained(out)
    for f in ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]:
        shutil.copy(tiny_dir / f, out / f)
    return model.eval()


@pytest.mark.parametrize("kind", ["qwen2", "llama-untied-llama3-rope", "mistral"])
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


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLM(str(tmp_path))
