"""Medusa speculative decoding (engine/spec/medusa_proposer.py) against plain decoding and HF.

The heads are built from the target's own output layer behind identity blocks
(tests/helpers.py `medusa_tensors_from_lm_head`): every head guesses that the token just produced
comes again. On builtin:tiny with its layers zeroed (greedy output repeats one token) that guess
is always right; on the loopy model sometimes. Every test checks the greedy tokens equal plain
decoding's and that no page and no kept hidden row is left behind.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from configs import EngineConfig
from engine import LLMEngine, SamplingParams
from engine.metrics.step_stats import StepStats
from engine.spec.medusa_proposer import MedusaProposer
from tests.helpers import (
    assert_no_page_leak,
    medusa_tensors_from_lm_head,
    prefill_and_ship,
    write_loopy_model,
    write_medusa_heads,
)
from tests.integration.test_spec_decode import GREEDY, assert_hf_greedy, check_same, make_engine, prompts_of, run


@pytest.fixture(scope="module")
def repeat_dir(tiny_dir, tmp_path_factory):
    """builtin:tiny with its decoder layers zeroed: greedy output repeats the prompt's last token."""
    dst = tmp_path_factory.mktemp("repeat") / "model"
    write_loopy_model(tiny_dir, dst, scale=0.0)
    return dst


@pytest.fixture(scope="module")
def heads_dir(lm_head_heads_dir):
    """Three heads, each tiny's (and so the loopy and repeat models') output layer: 'the same again'."""
    return lm_head_heads_dir


def medusa_config(heads_dir, **extra) -> dict:
    return {"method": "medusa", "medusa_heads": str(heads_dir), "num_tokens": 4, "max_batch_seqs": 0, **extra}


def proposer_of(engine: LLMEngine) -> MedusaProposer:
    proposer = engine.speculator.proposers["medusa"]
    assert isinstance(proposer, MedusaProposer)
    return proposer


def assert_rows_are_the_last_tokens(engine: LLMEngine) -> None:
    """Between steps each kept hidden row is the one the sequence's newest token came from: for a
    greedy request, its logits' argmax is that token (a verification's row 0, or any row but the
    last accepted token's, would give an earlier or another token)."""
    running = {seq.request_id: seq for seq in engine.scheduler.running}
    for request_id, kept in proposer_of(engine).hidden.items():
        seq = running[request_id]
        if kept.num_tokens == seq.num_tokens:
            token = int(engine.runner.logits(kept.row[None]).argmax(-1))
            assert token == seq.token_ids[-1], (request_id, seq.num_tokens)


def assert_nothing_kept(engine: LLMEngine) -> None:
    assert not proposer_of(engine).hidden
    assert_no_page_leak(engine)


@pytest.fixture(scope="module")
def untied_heads_dir(tiny_dir, tmp_path_factory):
    """The same guesses from projections that are not the target's own (twice its weight: the
    argmax is the same), so the heads multiply their own packed projections."""
    tensors = {name: t * 2 if name.endswith("1.weight") else t
               for name, t in medusa_tensors_from_lm_head(tiny_dir, 3).items()}
    return write_medusa_heads(tmp_path_factory.mktemp("untied-heads"), tensors, 3)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_heads_that_predict_the_target_are_always_accepted(repeat_dir, heads_dir, untied_heads_dir, tied):
    from engine.metrics.peak import Peak
    from engine.metrics.worker_metrics import WorkerMetrics

    prompts = prompts_of(3, 30, seed=71)
    plain = run(make_engine(repeat_dir), {0: dict(prompts)}, GREEDY)
    engine = make_engine(repeat_dir, medusa_config(heads_dir if tied else untied_heads_dir))
    # Heads whose projections are the target's are multiplied by the target's, all in one product.
    assert (proposer_of(engine).heads.shared_projection is not None) == tied
    metrics = WorkerMetrics(engine, "d0", "decode", Peak.configured(10.0, 1.0))
    engine.add_step_observer(metrics.observe_step)
    spec = run(engine, {0: dict(prompts)}, GREEDY, check=assert_rows_are_the_last_tokens)
    proposed, accepted = check_same(plain, spec)
    assert proposed > 0 and accepted == proposed
    totals = engine.speculator.totals["medusa"]
    # k = min(3 heads, the request's 4) each step but a request's last (what max_tokens leaves).
    assert 3 * (totals.num_verified - len(prompts)) < totals.num_proposed <= 3 * totals.num_verified
    assert totals.num_verified <= 0.3 * len(prompts) * GREEDY.max_tokens
    # The worker's per-method metrics count them under method="medusa".
    labels = {"worker_id": "d0", "role": "decode", "method": "medusa"}
    assert metrics.registry.get_sample_value("pdserve_worker_spec_proposed_tokens_total", labels) == proposed
    assert metrics.registry.get_sample_value("pdserve_worker_spec_accepted_tokens_total", labels) == accepted
    assert metrics.registry.get_sample_value("pdserve_worker_spec_mean_accepted_length", labels) == pytest.approx(
        (accepted + totals.num_verified) / totals.num_verified)
    assert_nothing_kept(engine)


def test_partly_right_heads_keep_greedy_output_the_targets(loopy_dir, hf_loopy, heads_dir):
    prompts = prompts_of(4, 30, seed=73)
    plain = run(make_engine(loopy_dir), {0: dict(prompts)}, GREEDY)
    engine = make_engine(loopy_dir, medusa_config(heads_dir))
    spec = run(engine, {0: dict(prompts)}, GREEDY, check=assert_rows_are_the_last_tokens)
    proposed, accepted = check_same(plain, spec)
    assert 0 < accepted < proposed
    assert_hf_greedy(spec, dict(list(prompts.items())[:2]), hf_loopy)
    assert_nothing_kept(engine)


def test_a_requests_k_below_the_heads_proposes_that_many(repeat_dir, heads_dir):
    engine = make_engine(repeat_dir, medusa_config(heads_dir))
    # The first token and 10 steps of 2 accepted guesses and the target's own token.
    params = SamplingParams(max_tokens=31, ignore_eos=True, num_speculative_tokens=2)
    run(engine, {0: dict(prompts_of(2, 20, seed=75))}, params)
    totals = engine.speculator.totals["medusa"]
    assert totals.num_verified == 2 * 10 and totals.num_proposed == 2 * totals.num_verified
    assert_nothing_kept(engine)


def test_chunked_prompts_and_staggered_arrivals(loopy_dir, heads_dir):
    prompts = prompts_of(3, 70, seed=77)
    arrivals = {0: {"r0": prompts["r0"]}, 9: {"r1": prompts["r1"]}, 15: {"r2": prompts["r2"]}}
    config = dict(max_num_batched_tokens=24, max_num_seqs=4)
    params = SamplingParams(max_tokens=32, ignore_eos=True, logprobs=True)
    plain = run(make_engine(loopy_dir, **config), {k: dict(v) for k, v in arrivals.items()}, params)
    engine = make_engine(loopy_dir, medusa_config(heads_dir), **config)
    proposed, accepted = check_same(plain, run(engine, arrivals, params, check=assert_rows_are_the_last_tokens))
    assert 0 < accepted < proposed
    assert_nothing_kept(engine)


def test_preemption_drops_the_row_and_recomputation_brings_it_back(loopy_dir, hf_loopy, heads_dir):
    prompts = prompts_of(4, 28, seed=79)
    engine = make_engine(loopy_dir, medusa_config(heads_dir), num_pages=16, enable_prefix_caching=False)
    spec = run(engine, {0: dict(prompts)}, GREEDY, check=assert_rows_are_the_last_tokens)
    assert engine.scheduler.num_preemptions > 0
    assert sum(o.num_spec_accepted for o in spec.values()) > 0
    assert_hf_greedy(spec, prompts, hf_loopy)
    assert_nothing_kept(engine)


def test_abort_mid_speculation_frees_pages_and_rows(loopy_dir, heads_dir):
    engine = make_engine(loopy_dir, medusa_config(heads_dir))
    prompts = prompts_of(3, 30, seed=81)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, GREEDY)
    for _ in range(6):
        engine.step()
    assert engine.speculator.totals["medusa"].num_verified > 0 and proposer_of(engine).hidden
    for rid in prompts:
        assert engine.abort_request(rid)
    assert_nothing_kept(engine)


def test_decode_worker_speculates_from_its_first_own_step(repeat_dir, heads_dir):
    """Disaggregated: the prompt's last hidden row stays on the prefill side, so the decode
    engine's first step after the handoff is a plain decode; it speculates from the next one."""
    prompts = prompts_of(3, 40, seed=83)
    plain = run(make_engine(repeat_dir), {0: dict(prompts)}, GREEDY)
    prefill = make_engine(repeat_dir)
    decode = make_engine(repeat_dir, medusa_config(heads_dir))
    for rid, ids in prompts.items():
        first = prefill_and_ship(prefill, decode, rid, ids)
        assert decode.add_prefilled_request(rid, ids, first, GREEDY) is None
    outs: dict = {}
    steps: list[StepStats] = []
    decode.add_step_observer(steps.append)
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.finished:
                outs[out.request_id] = out
        assert_rows_are_the_last_tokens(decode)
    assert not steps[0].spec.by_method and "medusa" in steps[1].spec.by_method
    for rid in prompts:
        assert outs[rid].token_ids == plain[rid].token_ids, rid
    accepted = sum(o.num_spec_accepted for o in outs.values())
    assert accepted == sum(o.num_spec_proposed for o in outs.values()) > 0
    assert_nothing_kept(decode)


def test_sampled_requests_verify_point_mass_guesses(loopy_dir, heads_dir):
    """The heads' guesses are argmaxes, verified like prompt lookup's (point masses: the rule the
    chi-square tests of tests/unit/test_rejection_sampling.py cover); with top_k=1 the target is
    a point mass too, so sampling must keep exactly the greedy tokens."""
    prompts = prompts_of(3, 25, seed=85)
    plain = run(make_engine(loopy_dir), {0: dict(prompts)}, GREEDY)
    top1 = SamplingParams(max_tokens=48, ignore_eos=True, logprobs=True, temperature=0.8, top_k=1, seed=4)
    engine = make_engine(loopy_dir, medusa_config(heads_dir))
    proposed, accepted = check_same(plain, run(engine, {0: dict(prompts)}, top1))
    assert 0 < accepted < proposed
    engine.add_request("probe", prompts["r0"], top1)
    engine.step()
    [seq] = engine.scheduler.running
    [proposal] = proposer_of(engine).propose([seq], [3])
    assert len(proposal) == 3 and proposal.draft_probs is None  # point masses, whatever the sampling
    engine.abort_request("probe")
    assert_nothing_kept(engine)


def test_requests_choose_medusa_where_heads_are_loaded(loopy_dir, heads_dir):
    prompts = prompts_of(2, 30, seed=87)
    engine = make_engine(loopy_dir, {"method": "prompt_lookup", "medusa_heads": str(heads_dir), "max_batch_seqs": 0})
    params = SamplingParams(max_tokens=40, ignore_eos=True, speculative_method="medusa")
    run(engine, {0: dict(prompts)}, params)
    assert engine.speculator.totals["medusa"].num_proposed > 0
    assert "prompt_lookup" not in engine.speculator.totals
    plain_engine = make_engine(loopy_dir)  # no heads: asking for medusa decodes without speculation
    run(plain_engine, {0: dict(prompts)}, params)
    assert not plain_engine.speculator.totals


def test_bad_medusa_settings_fail_with_their_reason(tiny_dir, small_vocab_heads):
    with pytest.raises(ValidationError, match="method 'medusa' needs speculative.medusa_heads"):
        EngineConfig(speculative={"method": "medusa"})
    with pytest.raises(ValueError, match="unknown built-in Medusa heads 'builtin:tiny'"):
        LLMEngine(EngineConfig(model=str(tiny_dir), speculative={"method": "medusa", "medusa_heads": "builtin:tiny"}))
    with pytest.raises(ValueError, match="project to a vocabulary of 2048, the target's has 4096"):
        LLMEngine(EngineConfig(model=str(tiny_dir),
                               speculative={"method": "medusa", "medusa_heads": str(small_vocab_heads)}))


@pytest.fixture
def small_vocab_heads(tiny_dir, tmp_path):
    tensors = medusa_tensors_from_lm_head(tiny_dir, 2)
    tensors = {name: t[:2048] if name.endswith("1.weight") else t for name, t in tensors.items()}
    return write_medusa_heads(tmp_path / "heads", tensors, 2)
