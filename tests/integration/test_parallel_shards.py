"""Tensor and pipeline parallelism on CPU with gloo: a worker's ranks run as local
subprocesses (engine/parallel/shard_follower.py) and must produce Hugging Face's greedy tokens, free
every page, and move KV between engines of different shapes (prefill TP=2 -> decode TP=1,
TP=1 -> a two-stage pipeline), which regroups heads and layers on the way."""

from __future__ import annotations

import pytest

from configs import EngineConfig
from engine import LLM, LLMEngine, SamplingParams
from engine.parallel.shard_follower import start_local_group
from tests.helpers import assert_no_page_leak, hf_greedy, prefill_and_ship

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
BASE = [0] + list(range(200, 250))
PROMPTS = [BASE, BASE[:40] + [9, 10, 11], [0, 5, 6, 7]]  # the second shares 2 pages with the first
SMALL = dict(page_size=16, num_pages=48, max_num_batched_tokens=32, max_num_seqs=8)  # 51 tokens: chunked prefill


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)])
def test_sharded_worker_matches_hf(hf_tiny, tp, pp):
    with LLM("builtin:tiny", tensor_parallel_size=tp, pipeline_parallel_size=pp, **SMALL) as llm:
        first = llm.generate(PROMPTS[0], GREEDY)  # fills the prefix cache
        outs = llm.generate(PROMPTS, GREEDY)  # one batch: decodes, prefills and a prefix hit
        processes = llm._local_group.processes
        assert outs[1].num_cached_prompt_tokens == 32
        for prompt, out in zip(PROMPTS, outs):
            assert out.token_ids == hf_greedy(hf_tiny, prompt, GREEDY.max_tokens)[0]
        assert first[0].token_ids == outs[0].token_ids
        assert_no_page_leak(llm.engine)
    assert [p.exitcode for p in processes] == [0] * (tp * pp - 1)  # STOP ended every follower cleanly


def _sharded_engine(**kwargs) -> tuple[LLMEngine, object]:
    config = EngineConfig(model="builtin:tiny", **SMALL, **kwargs)
    local = start_local_group(config)
    return LLMEngine(config, local.group), local


def test_kv_moves_between_differently_sharded_engines(hf_tiny):
    tp2, tp2_group = _sharded_engine(tensor_parallel_size=2)
    pp2, pp2_group = _sharded_engine(pipeline_parallel_size=2)
    whole = LLMEngine(EngineConfig(model="builtin:tiny", **SMALL))
    try:
        for prefill, decode in ((tp2, whole), (whole, pp2)):
            for i, prompt in enumerate(PROMPTS):
                rid = f"r{i}"
                token = prefill_and_ship(prefill, decode, rid, prompt)
                assert decode.add_prefilled_request(rid, prompt, token, GREEDY) is None
            finished = {}
            while decode.has_unfinished_requests():
                finished.update({o.request_id: o for o in decode.step() if o.finished})
            for i, prompt in enumerate(PROMPTS):
                assert finished[f"r{i}"].token_ids == hf_greedy(hf_tiny, prompt, GREEDY.max_tokens)[0]
            assert_no_page_leak(prefill)
            assert_no_page_leak(decode)
    finally:
        for engine, local in ((tp2, tp2_group), (pp2, pp2_group)):
            engine.close()
            local.stop()


def test_sharded_config_without_a_group_is_refused():
    with pytest.raises(ValueError, match="needs a shard group"):
        LLMEngine(EngineConfig(model="builtin:tiny", tensor_parallel_size=2))


def test_model_that_does_not_split_is_refused():
    # builtin:tiny has 8 heads and 4 KV heads; a TP of 3 divides neither.
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide the model's num_attention_heads \(8\)"):
        LLM("builtin:tiny", tensor_parallel_size=3, **SMALL)
