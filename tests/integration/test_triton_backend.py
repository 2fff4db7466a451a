"""The whole engine on the Triton attention backend (kernels run in the Triton interpreter on
CPU): same tokens as Hugging Face, through prefill, chunked prefill, prefix hits and decode."""

from __future__ import annotations

import os

import pytest

from configs import EngineConfig
from engine import LLMEngine, SamplingParams
from tests.helpers import assert_no_page_leak, hf_greedy

pytest.importorskip("triton")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter on CPU")
def test_engine_on_triton_kernels_matches_hf(hf_tiny):
    engine = LLMEngine(EngineConfig(model="builtin:tiny", attention_backend="triton", page_size=8,
                                    max_num_batched_tokens=24, max_num_seqs=8))
    prompts = {"a": [0] + list(range(40, 70)), "b": [0] + list(range(40, 56)) + [7, 8, 9], "c": [0, 11]}
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    finished = {}
    for request_id, ids in prompts.items():
        engine.add_request(request_id, ids, params)
        for out in engine.step():  # staggered: decodes and prefill chunks share steps
            if out.finished:
                finished[out.request_id] = out
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert engine.model.backend.name == "triton"
    assert finished["b"].num_cached_prompt_tokens == 16  # shares two full pages with "a"
    for request_id, ids in prompts.items():
        assert finished[request_id].token_ids == hf_greedy(hf_tiny, ids, 6)[0]
    assert_no_page_leak(engine)


def test_triton_backend_is_refused_on_cpu_outside_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="attention_backend 'triton' needs device 'cuda'"):
        LLMEngine(EngineConfig(attention_backend="triton"))
