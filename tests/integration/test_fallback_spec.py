"""`prompt_lookup+draft` (engine/spec/fallback_proposer.py): prompt lookup where it finds a match,
the draft model where it finds none, against plain decoding and HF.

The loopy target repeats itself with breaks, so prompt lookup matches in some steps and not in
others: both parts propose. Every test checks greedy tokens equal plain decoding's and that the
target's and the draft's pages are all free afterwards.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from configs import EngineConfig
from engine import SamplingParams
from engine.spec.fallback_proposer import FallbackProposer
from tests.helpers import assert_no_page_leak
from tests.integration.test_draft_spec import assert_draft_pages_free, assert_twins_rolled_back, run_shipped
from tests.integration.test_spec_decode import GREEDY, assert_hf_greedy, check_same, make_engine, prompts_of, run

HYBRID = "prompt_lookup+draft"


def hybrid_config(draft_dir, **extra) -> dict:
    return {"method": HYBRID, "draft_model": str(draft_dir), "num_tokens": 4, "max_batch_seqs": 0, **extra}


def test_greedy_equals_plain_and_hf_with_both_parts_proposing(loopy_dir, hf_loopy, loopy_draft_dir):
    prompts = prompts_of(5, 30, seed=71)
    plain = run(make_engine(loopy_dir), {0: dict(prompts)}, GREEDY)
    engine = make_engine(loopy_dir, hybrid_config(loopy_draft_dir))
    spec = run(engine, {0: dict(prompts)}, GREEDY, check=assert_twins_rolled_back)
    proposed, accepted = check_same(plain, spec)
    assert 0 < accepted < proposed
    assert_hf_greedy(spec, dict(list(prompts.items())[:2]), hf_loopy)
    # Counted by who proposed, never under the method's own name; the request's totals are both.
    totals = engine.speculator.totals
    assert set(totals) == {"prompt_lookup", "draft"}
    assert all(c.num_proposed > 0 for c in totals.values())
    assert sum(c.num_proposed for c in totals.values()) == proposed
    assert sum(c.num_accepted for c in totals.values()) == accepted
    proposer = engine.speculator.proposers[HYBRID]
    assert isinstance(proposer, FallbackProposer) and not proposer.pending and not proposer.fallback_states
    assert_no_page_leak(engine)
    assert_draft_pages_free(engine)


def test_shares_steps_with_prefills_and_survives_preemption(loopy_dir, hf_loopy, loopy_draft_dir):
    prompts = prompts_of(4, 28, seed=73)
    arrivals = {0: {"r0": prompts["r0"], "r1": prompts["r1"]}, 7: {"r2": prompts["r2"]}, 12: {"r3": prompts["r3"]}}
    engine = make_engine(loopy_dir, hybrid_config(loopy_draft_dir), num_pages=16, max_num_batched_tokens=24,
                         max_num_seqs=4)
    spec = run(engine, arrivals, GREEDY, check=assert_twins_rolled_back)
    assert engine.scheduler.num_preemptions > 0
    assert_hf_greedy(spec, prompts, hf_loopy)
    assert_no_page_leak(engine)
    assert_draft_pages_free(engine)


def test_abort_mid_speculation_frees_both_sides(loopy_dir, loopy_draft_dir):
    engine = make_engine(loopy_dir, hybrid_config(loopy_draft_dir))
    prompts = prompts_of(3, 30, seed=75)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, GREEDY)
    for _ in range(8):
        engine.step()
    for rid in prompts:
        assert engine.abort_request(rid)
    proposer = engine.speculator.proposers[HYBRID]
    assert isinstance(proposer, FallbackProposer) and not proposer.pending and not proposer.fallback_states
    assert_no_page_leak(engine)
    assert_draft_pages_free(engine)


def test_sampling_with_a_point_mass_target_equals_greedy(loopy_dir, loopy_draft_dir):
    prompts = prompts_of(3, 25, seed=77)
    plain = run(make_engine(loopy_dir), {0: dict(prompts)}, GREEDY)
    sampled = SamplingParams(max_tokens=48, ignore_eos=True, logprobs=True, temperature=0.8, top_k=1, seed=4)
    engine = make_engine(loopy_dir, hybrid_config(loopy_draft_dir))
    proposed, accepted = check_same(plain, run(engine, {0: dict(prompts)}, sampled))
    assert 0 < accepted < proposed
    assert_draft_pages_free(engine)


def test_worker_metrics_label_the_part_that_proposed(loopy_dir, loopy_draft_dir):
    from engine.metrics.peak import Peak
    from engine.metrics.worker_metrics import WorkerMetrics

    engine = make_engine(loopy_dir, hybrid_config(loopy_draft_dir))
    metrics = WorkerMetrics(engine, "d0", "decode", Peak.configured(10.0, 1.0))
    engine.add_step_observer(metrics.observe_step)
    outs = run(engine, {0: prompts_of(3, 30, seed=79)}, GREEDY)
    value = metrics.registry.get_sample_value
    total = 0.0
    for method in ("prompt_lookup", "draft"):
        labels = {"worker_id": "d0", "role": "decode", "method": method}
        proposed = value("pdserve_worker_spec_proposed_tokens_total", labels)
        assert proposed == engine.speculator.totals[method].num_proposed > 0
        total += proposed
    assert total == sum(o.num_spec_proposed for o in outs.values())
    assert f'method="{HYBRID}"'.encode() not in metrics.exposition()


def test_requests_choose_it_where_a_draft_is_loaded(loopy_dir, loopy_draft_dir):
    prompts = prompts_of(2, 30, seed=81)
    params = SamplingParams(max_tokens=40, ignore_eos=True, speculative_method=HYBRID)
    engine = make_engine(loopy_dir, {"method": "none", "draft_model": str(loopy_draft_dir)})
    run(engine, {0: dict(prompts)}, params)
    assert engine.speculator.totals["draft"].num_proposed > 0
    plain_engine = make_engine(loopy_dir)  # no draft model: the method is not served, nothing proposed
    run(plain_engine, {0: dict(prompts)}, params)
    assert not plain_engine.speculator.totals
    assert_draft_pages_free(engine)


def test_the_method_needs_a_draft_model():
    with pytest.raises(ValidationError, match="method 'prompt_lookup\\+draft' needs speculative.draft_model"):
        EngineConfig(speculative={"method": HYBRID})


def test_on_a_decode_worker_the_prompt_kv_arrives_and_the_draft_recomputes_its_own(loopy_dir, loopy_draft_dir):
    prompts = prompts_of(3, 40, seed=85)
    plain = run(make_engine(loopy_dir), {0: dict(prompts)}, GREEDY)
    decode, outs = run_shipped(loopy_dir, hybrid_config(loopy_draft_dir), prompts)
    for rid in prompts:
        assert outs[rid].token_ids == plain[rid].token_ids, rid
    assert sum(o.num_spec_accepted for o in outs.values()) > 0
    assert_no_page_leak(decode)
    assert_draft_pages_free(decode)
