"""The engine's public surface: LLM.generate inputs, bad input that leaves the engine serving,
stop conditions, seeded sampling, abort, and the `pdserve complete` command."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from configs import EngineConfig
from engine import LLM, LLMEngine, SamplingParams
from tests.helpers import assert_no_page_leak, hf_greedy


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


def test_eos_from_generation_config_stops_like_hf(llm, tiny_dir, tmp_path):
    # Chat models add end-of-turn ids in generation_config.json; HF generate() stops on them.
    import json
    import shutil

    [free] = llm.generate("for i in range(10):", SamplingParams(max_tokens=30, ignore_eos=True))
    end_of_turn = free.token_ids[5]
    for f in tiny_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, end_of_turn]}))
    chat = LLM(str(tmp_path))
    assert chat.engine.model_config.eos_token_ids == (1, end_of_turn)
    [stopped] = chat.generate("for i in range(10):", SamplingParams(max_tokens=30))
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(end_of_turn) + 1]
    assert stopped.finish_reason == "stop"
    [ignored] = chat.generate("for i in range(10):", SamplingParams(max_tokens=30, ignore_eos=True))
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


def test_abort_of_waiting_and_preempted_requests_frees_pages():
    engine = LLMEngine(EngineConfig(model="builtin:tiny", page_size=8, num_pages=12, max_num_seqs=2,
                                    max_num_batched_tokens=64))
    for i in range(4):
        engine.add_request(f"r{i}", [0] + list(range(10 + i, 30 + i)), SamplingParams(max_tokens=40))
    engine.step()  # r0, r1 running; r2, r3 waiting
    assert engine.abort_request("r3")  # waiting, never admitted
    preempted = None
    while preempted is None and engine.has_unfinished_requests():
        engine.step()
        waiting = [s for s in engine.scheduler.waiting if s.num_preemptions]
        preempted = waiting[0].request_id if waiting else None
    assert preempted is not None, "the page budget should force a preemption"
    assert engine.abort_request(preempted)
    while engine.has_unfinished_requests():
        engine.step()
        running = [s.arrival_index for s in engine.scheduler.running]
        assert running == sorted(running)  # the newest is always the preemption victim
    assert_no_page_leak(engine)


def test_exact_fit_and_context_limits():
    engine = LLMEngine(EngineConfig(model="builtin:tiny", page_size=8, num_pages=4))
    # 16 prompt + 17 generated: the 17th is returned, never computed, so 32 slots suffice.
    engine.add_request("fit", list(range(3, 19)), SamplingParams(max_tokens=17, ignore_eos=True))
    with pytest.raises(ValueError, match="needs up to 33 tokens of KV cache"):
        engine.add_request("over", list(range(3, 19)), SamplingParams(max_tokens=18))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs[-1].token_ids) == 17 and outs[-1].finish_reason.value == "length"
    assert_no_page_leak(engine)
    with pytest.raises(ValueError, match="max_model_len=4096 exceeds the model's context of 2048"):
        LLMEngine(EngineConfig(model="builtin:tiny", max_model_len=4096))


def test_array_prompts_are_token_ids(llm):
    import numpy as np
    import torch

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ids = llm.engine.encode("while True:")
    [expected] = llm.generate(ids, params)
    [from_numpy] = llm.generate([np.array(ids)], params)
    [from_torch] = llm.generate(torch.tensor(ids), params)
    assert from_numpy.token_ids == from_torch.token_ids == expected.token_ids
    with pytest.raises(ValueError, match="prompt token ids must be integers"):
        llm.generate([[0, 1.5]], params)


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


def test_cli_complete_speculates_with_a_draft_model(tiny_dir):
    """The model as its own draft: every proposal is accepted, and the summary says so."""
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "complete", "def add(a, b):", "--max-tokens", "12",
                           "--ignore-eos", "--draft-model", str(tiny_dir), "--num-speculative-tokens", "3"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    accepted = re.search(r"speculative: (\d+)/(\d+) proposed tokens accepted", proc.stderr)
    assert accepted and accepted[1] == accepted[2] != "0", proc.stderr
    bad = subprocess.run([sys.executable, "-m", "cluster.cli", "complete", "x", "--speculative-method", "draft"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--speculative-method draft needs --draft-model" in bad.stderr
    helps = subprocess.run([sys.executable, "-m", "cluster.cli", "generate", "--help"], capture_output=True, text=True,
                           timeout=300)
    assert "--speculative-method" in helps.stdout and "--num-speculative-tokens" in helps.stdout


def test_cli_model_build_refuses_a_file_as_output(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "model", "build", "builtin:tiny", "--out", str(target)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "is not a directory" in proc.stderr
