"""Speculative decoding in the engine (engine/spec/) against plain decoding and Hugging Face.

The model is builtin:tiny made repetitive (tests/helpers.py `write_loopy_model`), so prompt lookup
is right sometimes and wrong other times; every test checks both happened, that the tokens (and
log-probabilities) equal plain greedy and HF greedy, and that no page is left referenced. An
oracle proposer (the true continuation, corrupted at known places) drives the cases that need
accepted runs at chosen positions: stop tokens and max_tokens inside a run.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from configs import EngineConfig
from engine import LLMEngine, SamplingParams
from engine.metrics.step_stats import StepStats
from engine.spec.proposer import BaseProposer, Proposal
from proto.block_hash import hash_full_pages
from tests.helpers import assert_no_page_leak, hf_greedy

LOGPROB_ATOL = 2e-3
# max_batch_seqs off: these tests batch more sequences than its default lets speculate.
LOOKUP = {"method": "prompt_lookup", "num_tokens": 4, "max_batch_seqs": 0}


def prompts_of(n: int, length: int = 30, seed: int = 0) -> dict[str, list[int]]:
    r = random.Random(seed)
    return {f"r{i}": [0] + [r.randrange(3, 4000) for _ in range(length - 1)] for i in range(n)}


def make_engine(model_dir, speculative=None, **config) -> LLMEngine:
    """The cost policy is off (unless `speculative` sets it): it decides by the wall clock, and these
    tests check the mechanism at chosen batch sizes (tests/unit/test_spec_cost_policy.py: the policy)."""
    config.setdefault("page_size", 8)
    speculative = {"cost_policy": False} | (speculative or {"method": "none"})
    return LLMEngine(EngineConfig(model=str(model_dir), speculative=speculative, **config))


def run(engine: LLMEngine, arrivals: dict[int, dict[str, list[int]]], params: SamplingParams,
        observe: list[StepStats] | None = None, check: Callable[[LLMEngine], None] | None = None) -> dict:
    """Feeds `arrivals` (step -> requests) and steps to the end; after every step the pages held
    are checked, and `check` (where given) runs too."""
    if observe is not None:
        engine.add_step_observer(observe.append)
    finished, step = {}, 0
    while arrivals or engine.has_unfinished_requests():
        for request_id, ids in arrivals.pop(step, {}).items():
            engine.add_request(request_id, ids, params)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        assert_no_draft_pages_held(engine)
        if check is not None:
            check(engine)
        step += 1
        assert step < 5000
    return finished


def assert_hf_greedy(spec: dict, prompts: dict[str, list[int]], hf) -> None:
    """Each request's tokens (outputs by request id) are Hugging Face's greedy ones for its prompt."""
    for rid, ids in prompts.items():
        assert spec[rid].token_ids == hf_greedy(hf, ids, GREEDY.max_tokens)[0], rid


def assert_no_draft_pages_held(engine: LLMEngine) -> None:
    """Between steps a sequence holds pages through its next token at most: those a rejected
    proposal took are back (the plain path holds as many)."""
    page_size = engine.config.page_size
    for seq in engine.scheduler.running:
        assert len(seq.page_table) <= -(-seq.num_tokens // page_size), (seq.request_id, seq.num_tokens)


GREEDY = SamplingParams(max_tokens=48, ignore_eos=True, logprobs=True)


def check_same(plain: dict, spec: dict) -> tuple[int, int]:
    """Tokens equal, log-probabilities close; returns the proposed and accepted totals."""
    assert set(plain) == set(spec)
    for rid in plain:
        assert spec[rid].token_ids == plain[rid].token_ids, rid
        assert spec[rid].logprobs == pytest.approx(plain[rid].logprobs, abs=LOGPROB_ATOL), rid
        assert spec[rid].finish_reason == plain[rid].finish_reason
        assert plain[rid].num_spec_proposed == 0
    return sum(o.num_spec_proposed for o in spec.values()), sum(o.num_spec_accepted for o in spec.values())


def test_prompt_lookup_greedy_equals_plain_and_hf(loopy_dir, hf_loopy):
    prompts = prompts_of(6)
    plain_engine, spec_engine = make_engine(loopy_dir), make_engine(loopy_dir, LOOKUP)
    plain = run(plain_engine, {0: dict(prompts)}, GREEDY)
    spec = run(spec_engine, {0: dict(prompts)}, GREEDY)
    proposed, accepted = check_same(plain, spec)
    assert 0 < accepted < proposed  # some proposals right, some wrong
    assert spec_engine.num_steps < plain_engine.num_steps  # accepted tokens saved steps
    for rid, ids in prompts.items():
        ref_tokens, ref_logprobs = hf_greedy(hf_loopy, ids, GREEDY.max_tokens)
        assert spec[rid].token_ids == ref_tokens, rid
        assert spec[rid].logprobs == pytest.approx(ref_logprobs, abs=LOGPROB_ATOL)
    totals = spec_engine.speculator.totals["prompt_lookup"]
    assert (totals.num_proposed, totals.num_accepted) == (proposed, accepted)
    assert_no_page_leak(spec_engine)
    assert not spec_engine.speculator.proposers["prompt_lookup"].indexes  # each finished request's n-grams went


def test_speculating_decodes_share_steps_with_prefill_chunks_and_prefix_hits(loopy_dir, hf_loopy):
    """Staggered arrivals, a small token budget (chunked prefill) and shared prefixes: steps mix
    prompt chunks, plain decodes and verifications; the outputs stay HF's."""
    base = prompts_of(1, 90, seed=5)["r0"]
    prompts = {"a": base, "b": base[:64] + [7, 8, 9], "c": prompts_of(1, 150, seed=6)["r0"], "d": base[:40],
               "e": base[:56] + [5, 6]}
    # Proposals take what a step's budget leaves, so a long prompt's chunks (b, c at step 12)
    # crowd them out; d and e arrive while the others speculate and are short past their prefix
    # hits (8 and 2 tokens): their steps verify proposals alongside a prompt chunk.
    arrivals = {0: {"a": prompts["a"]}, 12: {"b": prompts["b"], "c": prompts["c"]}, 28: {"d": prompts["d"]},
                34: {"e": prompts["e"]}}
    config = dict(max_num_batched_tokens=40, max_num_seqs=8, enable_prefix_caching=True)
    stats: list[StepStats] = []
    spec_engine = make_engine(loopy_dir, LOOKUP, **config)
    spec = run(spec_engine, {k: dict(v) for k, v in arrivals.items()}, GREEDY, stats)
    plain = run(make_engine(loopy_dir, **config), arrivals, GREEDY)
    proposed, accepted = check_same(plain, spec)
    assert 0 < accepted < proposed
    mixed = [s for s in stats if s.spec.by_method and s.work.num_prefill_tokens]
    assert mixed, "no step verified proposals alongside a prompt chunk"
    assert all(s.work.num_prefill_tokens + s.work.num_decode_tokens <= 40 for s in stats)  # within the budget
    assert spec_engine.page_manager.prefix_hit_tokens >= 64
    assert_hf_greedy(spec, prompts, hf_loopy)
    assert_no_page_leak(spec_engine)


def test_pages_published_to_the_prefix_cache_hold_only_accepted_tokens(loopy_dir, hf_loopy):
    """A finished speculating request's full pages (prompt and output) are cached under hashes of
    its accepted tokens; a request whose prompt is that text reuses them and still gets HF's
    answer (KV of rejected proposals in a cached page would change it)."""
    engine = make_engine(loopy_dir, LOOKUP, page_size=4)
    prompt = prompts_of(1, 21, seed=3)["r0"]
    first = run(engine, {0: {"a": prompt}}, GREEDY)["a"]
    assert 0 < first.num_spec_accepted < first.num_spec_proposed
    text = prompt + first.token_ids[:-1]  # every generated token but the last has KV
    hashes = hash_full_pages(text, 4)
    assert len(engine.page_manager.match_prefix(hashes)) == len(hashes)  # all cached, output included
    follow = text[:44] + [11, 12]
    again = run(engine, {0: {"b": follow}}, GREEDY)["b"]
    assert again.num_cached_prompt_tokens == 44
    assert again.token_ids == hf_greedy(hf_loopy, follow, GREEDY.max_tokens)[0]
    assert_no_page_leak(engine)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_with_speculation_matches_hf(loopy_dir, hf_loopy, prefix_caching):
    # 16 pages x 8 tokens = 128 slots for four requests needing up to 75 each: preemption is forced.
    prompts = prompts_of(4, 28, seed=9)
    engine = make_engine(loopy_dir, LOOKUP, num_pages=16, enable_prefix_caching=prefix_caching)
    spec = run(engine, {0: dict(prompts)}, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert sum(o.num_spec_accepted for o in spec.values()) > 0
    assert_hf_greedy(spec, prompts, hf_loopy)
    assert_no_page_leak(engine)
    assert not engine.speculator.proposers["prompt_lookup"].indexes  # preempted, then finished: released


class OracleProposer(BaseProposer):
    """Proposes the true greedy continuation, except every 4th generated position (3, 7, ...),
    where it proposes a wrong token: accepted runs and rejections at known places. With k = 5
    (fixed) the steps emit [0] [1 2 3] [4 5 6 7] [8 9 10 11] ...: in each run all but the last
    token are accepted proposals, the last is the target's own at the corrupted position."""

    method = "prompt_lookup"

    def __init__(self, reference: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.reference, self.vocab = reference, vocab

    def propose(self, seqs, max_num_tokens):
        out = []
        for seq, k in zip(seqs, max_num_tokens):
            ref = self.reference[tuple(seq.prompt_token_ids)]
            done = seq.num_tokens - seq.num_prompt_tokens
            tokens = [t if (done + i) % 4 != 3 else (t + 1) % self.vocab for i, t in enumerate(ref[done:done + k])]
            out.append(Proposal(tuple(tokens)))
        return out


def oracle_engine(model_dir, reference, **config) -> LLMEngine:
    fixed_k = {"method": "prompt_lookup", "num_tokens": 5, "adaptive": False, "max_batch_seqs": 0}
    engine = make_engine(model_dir, fixed_k, **config)
    engine.speculator.proposers["prompt_lookup"] = OracleProposer(reference, engine.model_config.vocab_size)
    return engine


def test_oracle_proposals_accept_runs_and_reject_at_the_corrupted_positions(loopy_dir):
    prompts = prompts_of(3, 20, seed=11)
    plain = run(make_engine(loopy_dir), {0: dict(prompts)}, GREEDY)
    reference = {tuple(p): plain[rid].token_ids for rid, p in prompts.items()}
    engine = oracle_engine(loopy_dir, reference)
    spec = run(engine, {0: dict(prompts)}, GREEDY)
    check_same(plain, spec)
    # Position 0 is the plain first step's. Then each step proposes from generated position g
    # (1, 4, 8, 12, ...) and is rejected at the next corrupted position (3, 7, 11, ...).
    for out in spec.values():
        assert out.num_spec_accepted > out.num_spec_proposed / 2
    assert_no_page_leak(engine)


@pytest.mark.parametrize("where", ["stop_token", "max_tokens"])
def test_a_stop_inside_an_accepted_run_ends_there(loopy_dir, where):
    prompt = prompts_of(1, 20, seed=13)["r0"]
    full = run(make_engine(loopy_dir), {0: {"a": prompt}}, GREEDY)["a"].token_ids
    if where == "stop_token":  # an accepted proposal in mid-run, not seen earlier in the output
        end = next(p for p in range(5, len(full)) if p % 4 in (1, 2) and full[p] not in full[:p])
    else:
        end = 9  # max_tokens = 10: the last step may propose only 1 (it could emit 2)
    params = SamplingParams(max_tokens=end + 1 if where == "max_tokens" else 40, ignore_eos=True, logprobs=True,
                            stop_token_ids=(full[end],) if where == "stop_token" else ())
    engine = oracle_engine(loopy_dir, {tuple(prompt): full})
    outs: list = []
    engine.add_request("a", prompt, params)
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].token_ids == full[: end + 1]
    assert outs[-1].finish_reason.value == ("stop" if where == "stop_token" else "length")
    assert sum(len(o.new_token_ids) for o in outs) == end + 1  # nothing emitted past the end
    assert len(outs[-1].logprobs) == end + 1
    assert max(len(o.new_token_ids) for o in outs) > 1  # runs were accepted
    assert_no_page_leak(engine)


def test_sampling_with_a_point_mass_target_equals_greedy(loopy_dir):
    """top_k=1 makes the target deterministic: rejection sampling must then keep exactly the
    greedy tokens (accept with probability 1 or 0), seeded or not."""
    prompts = prompts_of(3, 25, seed=17)
    plain = run(make_engine(loopy_dir), {0: dict(prompts)}, GREEDY)
    sampled = SamplingParams(max_tokens=48, ignore_eos=True, logprobs=True, temperature=0.8, top_k=1, seed=4)
    spec = run(make_engine(loopy_dir, LOOKUP), {0: dict(prompts)}, sampled)
    proposed, accepted = check_same(plain, spec)
    assert 0 < accepted < proposed


def test_seeded_sampling_with_speculation_repeats(loopy_dir):
    prompts = prompts_of(2, 25, seed=19)
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.7, top_k=3, seed=11)
    runs = [run(make_engine(loopy_dir, LOOKUP), {0: dict(prompts)}, params) for _ in range(2)]
    assert all(runs[0][rid].token_ids == runs[1][rid].token_ids for rid in prompts)
    assert sum(o.num_spec_proposed for o in runs[0].values()) > 0


def test_per_request_settings_override_the_engine(loopy_dir):
    prompts = prompts_of(2, 30, seed=23)
    off_by_default = make_engine(loopy_dir)
    on = run(off_by_default, {0: dict(prompts)},
             SamplingParams(max_tokens=40, ignore_eos=True, speculative_method="prompt_lookup"))
    assert sum(o.num_spec_proposed for o in on.values()) > 0
    on_by_default = make_engine(loopy_dir, LOOKUP)
    for override in (dict(num_speculative_tokens=0), dict(speculative_method="none")):
        off = run(on_by_default, {0: dict(prompts)}, SamplingParams(max_tokens=40, ignore_eos=True, **override))
        assert sum(o.num_spec_proposed for o in off.values()) == 0
    capped: list[StepStats] = []
    run(on_by_default, {0: dict(prompts)}, SamplingParams(max_tokens=40, ignore_eos=True, num_speculative_tokens=1),
        capped)
    verified = [c for s in capped for c in s.spec.by_method.values()]
    assert verified and all(c.num_proposed <= c.num_verified for c in verified)  # at most 1 per sequence


def test_speculation_stops_past_the_batch_token_threshold(loopy_dir):
    """max_batch_tokens: a step whose work reaches it gets no proposals (compute-bound)."""
    stats: list[StepStats] = []
    engine = make_engine(loopy_dir, {**LOOKUP, "max_batch_tokens": 12}, max_num_seqs=32)
    run(engine, {0: prompts_of(16, 20, seed=29)}, SamplingParams(max_tokens=40, ignore_eos=True), stats)
    for s in stats:
        if s.spec.by_method:
            assert s.work.num_prefill_tokens + s.work.num_decode_tokens <= 12
    # 16 decodes alone pass 12: while all run, nothing is proposed; as they finish, some is.
    full_decode_steps = [s for s in stats if s.work.num_decode_tokens >= 16 and not s.work.num_prefill_tokens]
    assert full_decode_steps and not any(s.spec.by_method for s in full_decode_steps)
    assert_no_page_leak(engine)


def test_no_proposals_in_steps_with_more_than_max_batch_seqs(loopy_dir):
    """The batch grows past max_batch_seqs (6) and shrinks back under it: every step above it
    goes without proposals, steps at or under it speculate, and greedy output stays plain's."""
    prompts = prompts_of(8, 24, seed=43)
    first, later = dict(list(prompts.items())[:2]), dict(list(prompts.items())[2:])
    arrivals = {0: first, 20: later}  # 2 sequences, then 8, then 6 when the first two finish
    engine = make_engine(loopy_dir, {**LOOKUP, "max_batch_seqs": 6, "max_batch_tokens": 0}, max_num_seqs=16)
    steps: list[tuple[int, int]] = []  # (sequences in the step, of which speculating)
    plan = engine.speculator.plan

    def recording_plan(out, scheduler):
        plan(out, scheduler)
        steps.append((len(out.scheduled), sum(s.draft is not None for s in out.scheduled)))

    engine.speculator.plan = recording_plan  # type: ignore[method-assign]
    spec = run(engine, {k: dict(v) for k, v in arrivals.items()}, GREEDY)
    assert not [s for s in steps if s[0] > 6 and s[1]], "a step above max_batch_seqs speculated"
    assert any(n > 6 for n, _ in steps)
    assert any(d for n, d in steps if n <= 2) and any(d for n, d in steps if 2 < n <= 6)
    check_same(run(make_engine(loopy_dir), arrivals, GREEDY), spec)
    assert_no_page_leak(engine)


def test_worker_metrics_count_proposed_and_accepted_by_method(loopy_dir):
    from engine.metrics.peak import Peak
    from engine.metrics.worker_metrics import WorkerMetrics

    engine = make_engine(loopy_dir, LOOKUP)
    metrics = WorkerMetrics(engine, "d0", "decode", Peak.configured(10.0, 1.0))
    engine.add_step_observer(metrics.observe_step)
    outs = run(engine, {0: prompts_of(3, 30, seed=31)}, GREEDY)
    proposed = sum(o.num_spec_proposed for o in outs.values())
    accepted = sum(o.num_spec_accepted for o in outs.values())
    value = metrics.registry.get_sample_value
    labels = {"worker_id": "d0", "role": "decode", "method": "prompt_lookup"}
    assert value("pdserve_worker_spec_proposed_tokens_total", labels) == proposed > 0
    assert value("pdserve_worker_spec_accepted_tokens_total", labels) == accepted > 0
    verified = engine.speculator.totals["prompt_lookup"].num_verified
    assert value("pdserve_worker_spec_verify_steps_total", labels) == verified > 0
    assert value("pdserve_worker_spec_acceptance_rate", labels) == pytest.approx(accepted / proposed)
    assert value("pdserve_worker_spec_mean_accepted_length", labels) == pytest.approx((accepted + verified) / verified)
    assert b'method="prompt_lookup"' in metrics.exposition()  # and the scrape shows them


def test_abort_while_speculating_frees_every_page(loopy_dir):
    engine = make_engine(loopy_dir, LOOKUP)
    prompts = prompts_of(3, 30, seed=37)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, GREEDY)
    steps = 0
    while not any(s.spec is not None and s.spec.num_accepted for s in engine.scheduler.running):
        assert engine.step() and steps < 40
        steps += 1
    assert engine.speculator.proposers["prompt_lookup"].indexes  # held while the requests run
    for rid in prompts:
        assert engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    assert_no_page_leak(engine)
    assert not engine.speculator.proposers["prompt_lookup"].indexes


def test_bf16_speculation_equals_plain_bf16(tiny_dir):
    """A verifying sequence's rows go through the decode kernel, as plain decoding's do: in bf16,
    where a prompt chunk's attention rounds differently, tokens and log-probabilities stay plain
    decoding's (attended as a chunk, 4 of 48 log-probabilities of a request moved by > 2e-3 here,
    and on stdlib prompts greedy tokens flipped at near-ties)."""
    prompts = prompts_of(8, 40, seed=41)
    # Pages of 16 tokens: the CPU kernel's shared-prefix group path needs whole 16-token tiles.
    plain = run(make_engine(tiny_dir, dtype="bfloat16", page_size=16), {0: dict(prompts)}, GREEDY)
    spec = run(make_engine(tiny_dir, LOOKUP, dtype="bfloat16", page_size=16), {0: dict(prompts)}, GREEDY)
    proposed, accepted = check_same(plain, spec)
    assert proposed > 0 and accepted < proposed
    # The same bits, not merely close: past 64 keys (here from the 25th token on) a
    # verification's rows across a page boundary once formed a shared-prefix group among
    # themselves and rounded their attention differently (tests/kernels/test_cpu_kernels.py).
    for rid in prompts:
        assert spec[rid].logprobs == plain[rid].logprobs, rid


def test_with_the_cost_policy_greedy_output_is_unchanged_and_steps_are_measured(loopy_dir):
    """Whatever the wall clock makes the policy choose, greedy tokens are plain decoding's."""
    prompts = prompts_of(3, 25, seed=23)
    plain = run(make_engine(loopy_dir), {0: dict(prompts)}, GREEDY)
    engine = make_engine(loopy_dir, LOOKUP | {"cost_policy": True})
    check_same(plain, run(engine, {0: dict(prompts)}, GREEDY))
    cost = engine.speculator.cost
    assert cost is not None
    measured = sum(s.on.num_samples for s in cost.methods.values()) + sum(e.num_samples for e in cost.off.values())
    assert measured > 0 and all(key[0] == "prompt_lookup" for key in cost.methods)
    assert_no_page_leak(engine)
