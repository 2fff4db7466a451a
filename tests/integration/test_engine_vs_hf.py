"""The engine against Hugging Face greedy generate() on builtin:tiny, token for token.

Each case drives a different engine mechanism (batching, chunked prefill, prefix cache,
preemption) and checks both the tokens and the per-position log-probabilities, then that no
page is left referenced.
"""

from __future__ import annotations

import pytest
import torch

from configs import EngineConfig
from engine import LLM, LLMEngine, SamplingParams
from tests.helpers import assert_no_page_leak, hf_greedy

LOGPROB_ATOL = 2e-3
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=True)


def prompt_ids(engine: LLMEngine, n: int, salt: int) -> list[int]:
    """A deterministic prompt of exactly n tokens (BOS + varied ids)."""
    vocab = engine.model_config.vocab_size
    return [0] + [(salt * 7919 + i * 104729) % (vocab - 3) + 3 for i in range(n - 1)]


def run_to_completion(engine: LLMEngine, arrivals: dict[int, list[tuple[str, list[int]]]], params=GREEDY):
    """Steps the engine, adding requests at the given step numbers; returns final outputs."""
    finished = {}
    step = 0
    while arrivals or engine.has_unfinished_requests():
        for request_id, ids in arrivals.pop(step, []):
            engine.add_request(request_id, ids, params)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        step += 1
        assert step < 10_000
    return finished


def check_against_hf(hf_tiny, prompt: list[int], out, max_tokens: int = GREEDY.max_tokens) -> None:
    ref_tokens, ref_logprobs = hf_greedy(hf_tiny, prompt, max_tokens)
    assert out.token_ids == ref_tokens
    assert out.logprobs == pytest.approx(ref_logprobs, abs=LOGPROB_ATOL)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("builtin:tiny")


def test_single_prompt_matches_hf(llm, hf_tiny):
    [out] = llm.generate("def fibonacci(n):\n    ", GREEDY)
    check_against_hf(hf_tiny, out.prompt_token_ids, out)
    assert out.finish_reason == "length" and len(out.token_ids) == GREEDY.max_tokens
    assert out.text == llm.engine.decode(out.token_ids)
    assert_no_page_leak(llm.engine)


# `auto` on CPU is the compiled kernel (kernels/cpu_ops.py); `torch` is its fallback path;
# `cpu+sdpa` is the compiled kernel for decodes with prefill chunks on torch's SDPA, the split
# the cpu backend makes for bf16 on AMX CPUs (engine/model/attention.py), forced here for every
# dtype so that it is tested on any CPU.
CPU_BACKENDS = ["auto", "torch", "cpu+sdpa"]


def engine_on(backend: str, **config) -> LLMEngine:
    if backend != "cpu+sdpa":
        return LLMEngine(EngineConfig(model="builtin:tiny", attention_backend=backend, **config))
    engine = LLMEngine(EngineConfig(model="builtin:tiny", attention_backend="cpu", **config))
    engine.model.backend.sdpa_prefill_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    return engine


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_staggered_batch_of_mixed_lengths_matches_hf(hf_tiny, backend):
    engine = engine_on(backend, page_size=8, max_num_batched_tokens=512)
    assert engine.model.backend.name == ("torch" if backend == "torch" else "cpu")
    prompts = {f"r{i}": prompt_ids(engine, n, i) for i, n in enumerate([3, 250, 17, 64, 1, 129])}
    arrivals = {0: [("r0", prompts["r0"]), ("r1", prompts["r1"])], 2: [("r2", prompts["r2"])],
                5: [("r3", prompts["r3"]), ("r4", prompts["r4"])], 11: [("r5", prompts["r5"])]}
    finished = run_to_completion(engine, arrivals)
    assert set(finished) == set(prompts)
    for request_id, ids in prompts.items():
        check_against_hf(hf_tiny, ids, finished[request_id])
    assert_no_page_leak(engine)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_chunked_prefill_matches_hf(hf_tiny, backend):
    engine = engine_on(backend, page_size=16, max_num_batched_tokens=48, max_num_seqs=8)
    prompts = {"long": prompt_ids(engine, 301, 1), "longer": prompt_ids(engine, 450, 2)}
    finished = run_to_completion(engine, {0: list(prompts.items())})
    # 751 prompt tokens under a 48-token budget need at least 16 prefill steps.
    assert engine.num_steps >= 751 // 48 + GREEDY.max_tokens - 1
    for request_id, ids in prompts.items():
        check_against_hf(hf_tiny, ids, finished[request_id])
    assert_no_page_leak(engine)


def test_prefix_cache_hits_match_hf(hf_tiny):
    engine = LLMEngine(EngineConfig(model="builtin:tiny", page_size=16))
    shared = prompt_ids(engine, 100, 3)
    first = run_to_completion(engine, {0: [("a", shared)]})["a"]
    assert first.num_cached_prompt_tokens == 0
    # The same prompt again, and two prompts that share its first 96 tokens.
    again = {"b": shared, "c": shared[:96] + [5, 6, 7], "d": shared[:50] + [9] * 30}
    finished = run_to_completion(engine, {0: list(again.items())})
    assert finished["b"].num_cached_prompt_tokens == 96  # 6 full pages; the last token recomputed
    assert finished["c"].num_cached_prompt_tokens == 96
    assert finished["d"].num_cached_prompt_tokens == 48
    assert engine.page_manager.prefix_hit_tokens == 96 + 96 + 48
    check_against_hf(hf_tiny, shared, first)
    for request_id, ids in again.items():
        check_against_hf(hf_tiny, ids, finished[request_id])
    assert_no_page_leak(engine)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_under_tiny_page_budget_matches_hf(hf_tiny, prefix_caching):
    # 12 pages x 8 tokens = 96 slots for four requests that need 60 each: preemption is forced.
    engine = LLMEngine(EngineConfig(model="builtin:tiny", page_size=8, num_pages=12,
                                    enable_prefix_caching=prefix_caching))
    prompts = {f"p{i}": prompt_ids(engine, 20 + i, 10 + i) for i in range(4)}
    finished = run_to_completion(engine, {0: list(prompts.items())})
    assert engine.scheduler.num_preemptions > 0
    for request_id, ids in prompts.items():
        check_against_hf(hf_tiny, ids, finished[request_id])
    assert_no_page_leak(engine)
