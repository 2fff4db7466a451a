"""`builtin:code-small` / `builtin:code-draft` and `pdserve model train / distill / build`, end to end
on a tiny recipe and a few stdlib files (the real recipes train for minutes: docs/engine.md)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import pytest
import torch

from cluster.cli import main
from engine.model import train_corpus, trained_builtins
from engine.model.builtin import ensure_builtin, parse_builtin
from engine.model.loader import resolve_model_path
from engine.model.own_text import OwnText
from engine.model.trained_builtins import DRAFT, STEPS_ENV, TARGET, MedusaRecipe, Recipe
from tests.helpers import hf_greedy
from tests.train_helpers import TINY_DRAFT, TINY_SETTINGS, TINY_TARGET, small_stdlib_corpus

TINY_OWN_TEXT = OwnText(num_windows=8, per_batch=2, prompt_len=32)  # the real recipe's shape, smaller
FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
         "special_tokens_map.json", "pdserve_builtin.json"]


@pytest.fixture(scope="module")
def corpus_root(tmp_path_factory):
    return small_stdlib_corpus(tmp_path_factory.mktemp("stdlib"))


@pytest.fixture
def tiny_recipes(monkeypatch, corpus_root):
    """The built-in names, on the tiny recipe and the small corpus."""
    monkeypatch.setattr(train_corpus, "stdlib_dir", lambda: corpus_root)
    monkeypatch.setitem(trained_builtins.RECIPES, TARGET, Recipe(TINY_TARGET, TINY_SETTINGS))
    monkeypatch.setitem(trained_builtins.RECIPES, DRAFT, Recipe(TINY_DRAFT, replace(TINY_SETTINGS, seed=1),
                                                                TINY_OWN_TEXT))
    monkeypatch.delenv(STEPS_ENV, raising=False)


def digests(path) -> dict[str, str]:
    return {f: hashlib.sha256((path / f).read_bytes()).hexdigest() for f in FILES}


def about(path) -> dict:
    return json.loads((path / "pdserve_builtin.json").read_text())


def test_the_names_parse_and_unknown_ones_list_them():
    assert parse_builtin("builtin:code-small") == "code-small"
    assert parse_builtin("builtin:code-draft") == "code-draft"
    with pytest.raises(ValueError, match="builtin:code-small"):
        parse_builtin("builtin:code-huge")


def test_the_loader_trains_them_on_first_use_then_reuses_the_cache(tiny_recipes, tmp_path, capfd):
    draft_dir = resolve_model_path("builtin:code-draft", str(tmp_path))
    target_dir = tmp_path / f"builtin-code-small-{trained_builtins.FORMAT_VERSION}"
    assert draft_dir == tmp_path / f"builtin-code-draft-{trained_builtins.FORMAT_VERSION}"
    assert (target_dir / "model.safetensors").is_file()  # the draft's target was trained first
    err = capfd.readouterr().err
    assert "held-out loss" in err and "perplexity" in err and "top-1 agreement with the target" in err
    assert (draft_dir / "tokenizer.json").read_bytes() == (target_dir / "tokenizer.json").read_bytes()
    assert about(target_dir)["kind"] == "trained target" and about(target_dir)["settings"]["steps"] == 20
    assert about(draft_dir)["target"] == "builtin:code-small"
    assert about(draft_dir)["copied_from_target"] > 0
    assert about(draft_dir)["own_text"] == {"num_windows": 8, "per_batch": 2, "prompt_len": 32}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".building")]

    stamp = (draft_dir / "model.safetensors").stat().st_mtime_ns, (target_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path("builtin:code-draft", str(tmp_path)) == draft_dir
    assert resolve_model_path("builtin:code-small", str(tmp_path)) == target_dir
    assert stamp == ((draft_dir / "model.safetensors").stat().st_mtime_ns,
                     (target_dir / "model.safetensors").stat().st_mtime_ns)
    assert "held-out" not in capfd.readouterr().err  # nothing trained the second time


def test_a_recipe_version_change_is_a_new_cache_entry(tiny_recipes, tmp_path, monkeypatch):
    first = ensure_builtin(TARGET, tmp_path)
    monkeypatch.setattr(trained_builtins, "FORMAT_VERSION", "t-next")
    second = ensure_builtin(TARGET, tmp_path)
    assert second != first and second.name.endswith("-t-next")
    assert digests(first) == digests(second)  # same recipe here: the stale entry is just not looked at


def test_the_steps_override_is_cached_under_its_own_name(tiny_recipes, tmp_path, monkeypatch):
    monkeypatch.setenv(STEPS_ENV, "2")
    path = ensure_builtin(TARGET, tmp_path)
    assert path.name == f"builtin-code-small-{trained_builtins.FORMAT_VERSION}-steps2"
    assert about(path)["settings"]["steps"] == 2
    monkeypatch.setenv(STEPS_ENV, "0")
    with pytest.raises(ValueError, match=STEPS_ENV):
        ensure_builtin(TARGET, tmp_path)


def test_the_engine_serves_them_as_transformers_does(tiny_recipes, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine import LLM, SamplingParams

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    for name in ("builtin:code-small", "builtin:code-draft"):
        path = resolve_model_path(name)
        tok = AutoTokenizer.from_pretrained(str(path))
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        prompt = tok("def read(self, path):\n")["input_ids"]
        llm = LLM(name, page_size=8, max_num_batched_tokens=64)
        out = llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]
        assert out.token_ids == hf_greedy(hf, prompt, 16)[0], name


def test_cli_train_and_distill_write_what_they_print(tiny_recipes, tmp_path, capsys):
    target, draft = tmp_path / "target", tmp_path / "draft"
    assert main(["model", "train", "--out", str(target), "--steps", "3", "--seed", "5", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "held-out loss" in out and "perplexity" in out and f"wrote {target}" in out
    settings = about(target)["settings"]
    assert (settings["steps"], settings["seed"], about(target)["compute"]["threads"]) == (3, 5, 1)
    assert f"{about(target)['held_out_loss']:.4f}" in out

    assert main(["model", "distill", "--target", str(target), "--out", str(draft), "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "top-1 agreement with the target" in out and "KL(target||draft)" in out
    assert about(draft)["target"] == str(target) and about(draft)["settings"]["steps"] == 2
    assert (draft / "tokenizer.json").read_bytes() == (target / "tokenizer.json").read_bytes()
    with pytest.raises(SystemExit, match="not empty"):
        main(["model", "train", "--out", str(target)])


def test_cli_defaults_reproduce_the_builtin_and_build_copies_it(tiny_recipes, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    assert main(["model", "train", "--out", str(tmp_path / "trained")]) == 0
    assert main(["model", "build", "builtin:code-small", "--out", str(tmp_path / "built")]) == 0
    cached = ensure_builtin(TARGET)
    assert digests(tmp_path / "trained") == digests(cached) == digests(tmp_path / "built")


def test_code_medusa_is_fitted_to_code_small_on_first_use_and_serves(tiny_recipes, tmp_path, monkeypatch, capfd):
    """builtin:code-medusa names heads, not a model: trained after its target into the same cache,
    loaded by an engine serving that target, and reused."""
    from configs import EngineConfig
    from engine import LLMEngine, SamplingParams

    monkeypatch.setattr(trained_builtins, "MEDUSA_RECIPE", MedusaRecipe(2, 1, replace(TINY_SETTINGS, seed=3)))
    config = EngineConfig(model="builtin:code-small", cache_dir=str(tmp_path), dtype="float32",
                          speculative={"method": "medusa", "medusa_heads": "builtin:code-medusa", "max_batch_seqs": 0})
    engine = LLMEngine(config)
    heads_dir = tmp_path / f"builtin-code-medusa-{trained_builtins.FORMAT_VERSION}"
    assert json.loads((heads_dir / "config.json").read_text())["base_model_name_or_path"] == "builtin:code-small"
    assert "held-out loss" in capfd.readouterr().err
    with pytest.raises(ValueError, match="unknown built-in model 'builtin:code-medusa'"):
        parse_builtin("builtin:code-medusa")  # not a model name
    prompt = engine.encode("def add(a, b):\n    return")
    outs = {}
    for method in ("none", "medusa"):
        engine.add_request(method, prompt, SamplingParams(max_tokens=24, ignore_eos=True, speculative_method=method))
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs[out.request_id] = out
    assert outs["medusa"].token_ids == outs["none"].token_ids
    assert outs["medusa"].num_spec_proposed > 0
    stamp = (heads_dir / "medusa_lm_head.safetensors").stat().st_mtime_ns
    LLMEngine(config)
    assert (heads_dir / "medusa_lm_head.safetensors").stat().st_mtime_ns == stamp
    assert "held-out" not in capfd.readouterr().err  # nothing trained the second time
