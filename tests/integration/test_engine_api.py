"""The engine's public surface: LLM.generate inputs, bad input that leaves the engine serving,
stop conditions, seeded sampling, abort, and the `pdserve complete` command."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tests.helpers import assert_no_page_leak, hf_greedy

from configs import EngineConfig
from engine import LLM, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("builtin:tiny", page_size=8)


def test_text_and_token_id_prompts_agree(llm):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    text_out, ids_out = llm.generate(["x = [1, 2, 3]", llm.engine.encode("x = [1, 2, 3]")], params)
    assert text_out.prompt_token_ids == ids_out.prompt_token_ids
    assert text_out.token_ids == ids_out.token_ids
    [single] = llm.generate(llm.engine.encode("x = [1, 2, 3]"), params)  # a bare list is one prompt
    assert single.token_ids == ids_out.token_ids


@pytest.mark.parametrize(
    ("prompt", "params", "error", "message"),
    [
        ("", None, ValueError, "prompt is empty"),
        ([], None, ValueError, "prompt is empty"),
        ([0] * 2048, None, ValueError, "context is 2048 tokens"),
        ([0, 99999], None, ValueError, r"token ids outside \[0, 4096\)"),
        ([0, -1], None, ValueError, "token ids outside"),
        ("ok", SamplingParams(max_tokens=1_000_000), ValueError, "whole cache holds"),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(hf_tiny, prompt, params, error, message):
    engine = LLMEngine(EngineConfig(model="builtin:tiny", page_size=8, num_pages=64))
    good = [0] + list(range(10, 40))
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    engine.add_request("good", good, greedy)
    engine.step()  # the good request is mid-flight when the bad one arrives
    with pytest.raises(error, match=message):
        ids = engine.encode(prompt) if isinstance(prompt, str) else prompt
        engine.add_request("bad", ids, params or greedy)
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.token_ids
    assert tokens == hf_greedy(hf_tiny, good, 16)[0]
    assert_no_page_leak(engine)


def test_invalid_sampling_params_and_unknown_model():
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(top_p=0.0)
    with pytest.raises(FileNotFoundError, match="neither a built-in name"):
        LLM("/no/such/model/dir")


def test_generate_rejects_a_bad_prompt_without_leaving_others_queued(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished_requests()
    assert_no_page_leak(llm.engine)


def test_duplicate_request_id_is_rejected():
    engine = LLMEngine(EngineConfig(model="builtin:tiny"))
    engine.add_request("a", [0, 5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [0, 5, 6], SamplingParams(max_tokens=2))
    assert engine.abort_request("a") and not engine.abort_request("a")
    assert_no_page_leak(engine)


def test_stop_token_and_eos(llm):
    base = SamplingParams(max_tokens=30, ignore_eos=True)
    [free] = llm.generate("for i in range(10):", base)
    stop_at = free.token_ids[5]
    first = free.token_ids.index(stop_at)
    [stopped] = llm.generate("for i in range(10):", SamplingParams(max_tokens=30, stop_token_ids=[stop_at]))
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"
    # EOS: pretend the model's EOS is that token; without ignore_eos generation ends there.
    engine = llm.engine
    eos = engine.model_config.eos_token_ids
    object.__setattr__(engine.model_config, "eos_token_ids", (stop_at,))
    try:
        [eos_out] = llm.generate("for i in range(10):", SamplingParams(max_tokens=30))
        [ignored] = llm.generate("for i in range(10):", base)
    finally:
        object.__setattr__(engine.model_config, "eos_token_ids", eos)
    assert eos_out.token_ids == stopped.token_ids and eos_out.finish_reason == "stop"
    assert ignored.token_ids == free.token_ids


def test_seeded_sampling_is_reproducible_across_batches(llm):
    seeded = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    [alone] = llm.generate("import sys", seeded)
    crowd = llm.generate(["import sys", "x", "def f():"],
                         [seeded, SamplingParams(max_tokens=5, temperature=1.0), SamplingParams(max_tokens=9)])
    assert crowd[0].token_ids == alone.token_ids
    [other_seed] = llm.generate("import sys", SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9,
                                                             top_k=50, seed=8, ignore_eos=True))
    assert other_seed.token_ids != alone.token_ids
    [greedy] = llm.generate("import sys", SamplingParams(max_tokens=20, ignore_eos=True))
    assert alone.token_ids != greedy.token_ids


def test_abort_mid_flight_frees_pages():
    engine = LLMEngine(EngineConfig(model="builtin:tiny", page_size=8))
    engine.add_request("a", [0] + list(range(5, 100)), SamplingParams(max_tokens=50))
    engine.add_request("b", [0] + list(range(5, 50)), SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.page_stats()["referenced"] > 0
    assert engine.abort_request("a")
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_page_leak(engine)


def test_cli_complete_streams_text():
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "complete", "def add(a, b):", "--max-tokens", "8"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def add(a, b):") and len(proc.stdout) > len("def add(a, b):")
    assert "8 tokens, finish=length" in proc.stderr
    bad = subprocess.run([sys.executable, "-m", "cluster.cli", "complete", "x", "--top-p", "2"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "top_p must be in (0, 1]" in bad.stderr
