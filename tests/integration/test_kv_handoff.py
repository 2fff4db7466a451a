"""Disaggregation through the engine, transport-free: one engine prefills and holds the KV,
its pages are copied into another engine's reservation, and that engine decodes. The result
must be Hugging Face's greedy output, and both engines must end with no page referenced."""

from __future__ import annotations

import pytest

from configs import EngineConfig
from engine import LLMEngine, SamplingParams
from tests.helpers import assert_no_page_leak, hf_greedy, prefill_and_ship

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def engines(**decode_kwargs) -> tuple[LLMEngine, LLMEngine]:
    prefill = LLMEngine(EngineConfig(model="builtin:tiny", page_size=8, max_num_batched_tokens=64, max_num_seqs=8))
    decode = LLMEngine(EngineConfig(model="builtin:tiny", page_size=8, **decode_kwargs))
    return prefill, decode


def test_prefill_on_one_engine_decode_on_another_matches_hf(hf_tiny):
    prefill, decode = engines()
    base = [0] + list(range(100, 140))
    prompts = {"a": base, "b": base[:33] + [7, 8, 9], "c": [0, 5, 6], "d": base[:16]}
    for request_id, prompt in prompts.items():
        first = prefill_and_ship(prefill, decode, request_id, prompt)
        assert decode.add_prefilled_request(request_id, prompt, first, GREEDY) is None
        decode.step()  # requests join a batch that is already decoding
    # "b" shares 4 full pages with "a", "d" exactly 2: only the rest was sent.
    finished = {}
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.finished:
                finished[out.request_id] = out
    assert decode.page_manager.prefix_hit_tokens == 32 + 16
    for request_id, prompt in prompts.items():
        assert finished[request_id].token_ids == hf_greedy(hf_tiny, prompt, GREEDY.max_tokens)[0]
    assert_no_page_leak(prefill)
    assert_no_page_leak(decode)


def test_first_token_can_finish_the_request():
    prefill, decode = engines()
    first = prefill_and_ship(prefill, decode, "r", [0, 11, 12])
    out = decode.add_prefilled_request("r", [0, 11, 12], first, SamplingParams(max_tokens=1))
    assert out is not None and out.finished and out.token_ids == [first]
    assert not decode.has_unfinished_requests()
    assert_no_page_leak(prefill)
    assert_no_page_leak(decode)


def test_reservations_apply_backpressure_and_free_exactly_once():
    prefill, decode = engines(num_pages=4)  # 32 slots
    with pytest.raises(ValueError, match="needs more KV pages than this cache has"):
        decode.handoff.reserve("big", list(range(3, 40)))  # 37 tokens: never fits
    assert decode.page_stats()["referenced"] == 0
    res = decode.handoff.reserve("r1", list(range(3, 20)))  # 17 tokens -> 3 pages
    assert len(res.page_ids) == 3
    assert decode.handoff.reserve("r2", list(range(3, 20))) is None  # 1 page left: retry later
    with pytest.raises(ValueError, match="already holds pages"):
        decode.handoff.reserve("r1", [0, 1])
    with pytest.raises(ValueError, match="already in use"):
        decode.add_request("r1", [0, 1], GREEDY)
    with pytest.raises(ValueError, match="reservation covers 17 tokens, the prompt has 2"):
        decode.add_prefilled_request("r1", [0, 1], 5, GREEDY)
    decode.handoff.cancel("r1")  # e.g. the lease expired before prefill delivered
    with pytest.raises(ValueError, match="no pages are reserved"):
        decode.handoff.cancel("r1")
    assert_no_page_leak(decode)
    # The prefill side: held KV is freed by release, or by abort_request, once.
    prefill.add_request("p", [0, 1, 2, 3], SamplingParams(max_tokens=1), hold_kv=True)
    while prefill.has_unfinished_requests():
        prefill.step()
    assert prefill.page_stats()["referenced"] == 1
    assert prefill.abort_request("p") and not prefill.abort_request("p")
    with pytest.raises(ValueError, match="no KV is held"):
        prefill.handoff.release("p")
    assert_no_page_leak(prefill)
