"""The built-in checkpoints: reproducible bytes, loadable by transformers offline, not degenerate."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.model.builtin import BUILTIN_SPECS, build_builtin, parse_builtin
from tests.helpers import hf_greedy

FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"]


def digests(path: Path) -> dict[str, str]:
    return {f: hashlib.sha256((path / f).read_bytes()).hexdigest() for f in FILES}


def test_building_twice_gives_identical_bytes(tmp_path):
    a = build_builtin("tiny", tmp_path / "a")
    b = build_builtin("tiny", tmp_path / "b")
    assert digests(a) == digests(b)


def test_cli_build_writes_same_checkpoint_as_cache(tmp_path, tiny_dir):
    out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "model", "build", "builtin:tiny", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert digests(out) == digests(tiny_dir)
    again = subprocess.run([sys.executable, "-m", "cluster.cli", "model", "build", "builtin:tiny", "--out", str(out)],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode != 0 and "not empty" in again.stderr


def test_unknown_builtin_name_is_rejected():
    with pytest.raises(ValueError, match="unknown built-in model 'builtin:huge'"):
        parse_builtin("builtin:huge")
    assert parse_builtin("/some/dir") is None


def test_transformers_loads_it_offline(tiny_dir, hf_tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    ids = tok("def main():\n    return 0")["input_ids"]
    assert ids[0] == 0  # BOS added, Llama-style
    assert tok.decode(ids, skip_special_tokens=True) == "def main():\n    return 0"
    spec = BUILTIN_SPECS["tiny"]
    assert tok.vocab_size == spec.vocab_size
    assert hf_tiny.config.num_key_value_heads == spec.num_kv_heads < spec.num_heads  # GQA
    n_params = sum(p.numel() for p in hf_tiny.parameters())
    assert 1e6 < n_params < 1e7


def test_small_spec_is_about_100m_parameters():
    s = BUILTIN_SPECS["small"]
    head_dim = s.hidden_size // s.num_heads
    per_layer = (s.hidden_size * head_dim * (2 * s.num_heads + 2 * s.num_kv_heads)
                 + 3 * s.hidden_size * s.intermediate_size + 2 * s.hidden_size)
    total = s.vocab_size * s.hidden_size + s.num_layers * per_layer + s.hidden_size
    assert (s.vocab_size, s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.intermediate_size) == (
        32000, 768, 12, 12, 4, 2048)
    assert 90e6 < total < 110e6


def test_greedy_continuations_depend_on_the_prompt(hf_tiny, tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    prompts = ["import os", "class Parser:", "def __init__(self):", "return None"]
    continuations = [hf_greedy(hf_tiny, tok(p)["input_ids"], 64)[0] for p in prompts]
    assert len({tuple(c) for c in continuations}) == len(prompts)
    for c in continuations:
        assert len(set(c)) >= 24, f"only {len(set(c))} distinct tokens in 64: degenerate model"


def test_weights_are_deterministic_across_processes(tmp_path, tiny_dir):
    code = ("import hashlib,sys; from engine.model.builtin import _init_weights, BUILTIN_SPECS;"
            "t=_init_weights(BUILTIN_SPECS['tiny']);"
            "print(hashlib.sha256(b''.join(t[k].numpy().tobytes() for k in sorted(t))).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    from engine.model.builtin import _init_weights

    t = _init_weights(BUILTIN_SPECS["tiny"])
    local = hashlib.sha256(b"".join(t[k].numpy().tobytes() for k in sorted(t))).hexdigest()
    assert out.stdout.strip() == local
    assert torch.equal(t["model.embed_tokens.weight"], _init_weights(BUILTIN_SPECS["tiny"])["model.embed_tokens.weight"])
