"""engine/spec/cost_policy.py and its use by the speculator: a method whose steps emit fewer
tokens per second than plain steps is turned off, a winning one stays on, and each is re-probed.
Synthetic timings: the policy alone with made-up step costs, and the speculator with an injected
clock that a fake model step advances."""

from __future__ import annotations

import pytest
import torch

from configs.engine import SpeculativeConfig
from engine.page_manager import PageManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.spec import Speculator
from engine.spec.cost_policy import CostPolicy, size_bucket
from engine.spec.proposer import Proposal
from tests.unit.test_spec_batch_policy import AlwaysProposer, decoding_batch


def drive(policy: CostPolicy, method: str, num_seqs: int, num_steps: int, plain_s: float, spec_s: float,
          accepted_per_step: float) -> list[bool]:
    """`num_steps` steps of `num_seqs` decodes: a plain step takes plain_s and emits one token a
    sequence; a speculating one takes spec_s and emits accepted_per_step more. Returns the decisions."""
    decisions = []
    for _ in range(num_steps):
        on = policy.should_propose(method, num_seqs)
        decisions.append(on)
        if on:
            policy.record({method}, num_seqs, round(num_seqs + accepted_per_step), spec_s)
        else:
            policy.record(set(), num_seqs, num_seqs, plain_s)
    return decisions


def probe_starts(decisions: list[bool], probing: bool) -> list[int]:
    """Where runs of `probing` decisions start."""
    return [i for i, d in enumerate(decisions) if d == probing and (i == 0 or decisions[i - 1] != probing)]


def test_a_losing_method_is_turned_off_after_warm_up_and_re_probed_ever_more_rarely():
    policy = CostPolicy(min_samples=4, probe_interval=20, probe_steps=2, probe_budget=1.0)
    # Draft-like: a step costs 1.8x a plain one and gains 0.5 tokens on 4 sequences: 4.5/1.8 < 4/1.
    decisions = drive(policy, "draft", 4, 200, plain_s=1.0, spec_s=1.8, accepted_per_step=0.5)
    # Its cost (a run's first step is measured apart: 5 steps for 4 samples), then the plain step's.
    assert decisions[:5] == [True] * 5 and decisions[5:9] == [False] * 4
    steady = decisions[9:]
    # Probes of 2 steps after 8, 16, then every 20 decisions (the probe's second step not counted).
    assert probe_starts(steady, True) == [7, 24, 45, 66, 87, 108, 129, 150, 171]
    assert steady.count(True) == 2 * 9 and steady[7:10] == [True, True, False]
    assert policy.methods[("draft", 4)].winning is False


def test_favours_follows_the_choice_without_counting_a_decision():
    """What a draft's prompt prefill asks (engine/spec/speculator.py): True until measured, then
    the side chosen at that size; asking moves no probe."""
    policy = CostPolicy(min_samples=4, probe_interval=20, probe_steps=2, probe_budget=1.0)
    assert policy.favours("draft", 4)
    drive(policy, "draft", 4, 12, plain_s=1.0, spec_s=1.8, accepted_per_step=0.5)  # losing: off
    state = policy.methods[("draft", 4)]
    before = (state.decisions_since_probe, state.num_declined)
    assert not policy.favours("draft", 4)
    assert (state.decisions_since_probe, state.num_declined) == before
    assert policy.favours("draft", 1)  # another size: not measured yet
    drive(policy, "prompt_lookup", 1, 12, plain_s=1.0, spec_s=1.1, accepted_per_step=1.2)
    assert policy.favours("prompt_lookup", 1)


def test_a_winning_method_stays_on_and_the_plain_step_is_re_measured():
    policy = CostPolicy(min_samples=4, probe_interval=20, probe_steps=2, probe_budget=1.0)
    # Prompt-lookup-like at batch 1: +10% time, 1.2 more tokens a step.
    decisions = drive(policy, "prompt_lookup", 1, 200, plain_s=1.0, spec_s=1.1, accepted_per_step=1.2)
    steady = decisions[9:]
    assert probe_starts(steady, False) == [7, 24, 45, 66, 87, 108, 129, 150, 171]  # plain steps only as probes
    assert policy.off[1].num_samples == 4 + 2 * 9
    assert policy.methods[("prompt_lookup", 1)].winning is True


def test_a_method_turned_off_comes_back_when_its_probes_find_it_paying():
    policy = CostPolicy(min_samples=2, probe_interval=10, probe_steps=3, probe_budget=1.0)
    drive(policy, "prompt_lookup", 2, 60, plain_s=1.0, spec_s=1.5, accepted_per_step=0.0)  # nothing accepted
    assert policy.methods[("prompt_lookup", 2)].winning is False
    # The text turns repetitive: the same step cost now emits 4 more tokens (6 vs 2 a step).
    later = drive(policy, "prompt_lookup", 2, 60, plain_s=1.0, spec_s=1.5, accepted_per_step=4.0)
    assert policy.methods[("prompt_lookup", 2)].winning is True
    assert later[-10:].count(True) >= 7  # on again, bar its own probes of the plain step


def test_a_dear_probe_waits_until_it_costs_at_most_its_budget():
    """A probe's expected cost (its steps at the other side's rate against the chosen side's) may
    be at most probe_budget of the chosen side's time since the last probe."""
    # Cheap to probe: 4 steps x (1.4 s - 5 tokens at 4 tokens/s) = 0.6 s, so about 30 s (30 plain
    # steps) between probes at a 2% budget; the decision gap (8, 16, ...) is not what holds it back.
    cheap = CostPolicy(min_samples=4, probe_interval=1000, probe_steps=4, probe_budget=0.02)
    steady = drive(cheap, "draft", 4, 300, plain_s=1.0, spec_s=1.4, accepted_per_step=1.0)[9:]
    assert cheap.probe_cost_s(cheap.methods[("draft", 4)], cheap.off[4]) == pytest.approx(0.6)
    starts = probe_starts(steady, True)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert abs(starts[0] - 30) <= 1 and all(abs(g - 34) <= 1 for g in gaps[:2])  # 30 plain steps + a 4-step probe
    assert gaps[2] == 64 + 3  # then the decision gap (8, 16, 32, 64) is the longer wait
    # Dear: a speculating step takes 5 s for nothing (a draft catching up): 4 x 4 s = 16 s, so
    # 800 plain steps between probes.
    dear = CostPolicy(min_samples=4, probe_interval=1000, probe_steps=4, probe_budget=0.02)
    steady = drive(dear, "draft", 4, 500, plain_s=1.0, spec_s=5.0, accepted_per_step=0.0)[9:]
    assert not any(steady)
    assert dear.methods[("draft", 4)].chosen_s_since_probe == pytest.approx(491.0)


def test_a_runs_first_step_is_a_probing_cost_not_the_methods():
    """A draft's first step after plain ones recomputes what it missed (here 6 s instead of 1.2):
    kept out of the method's means, it does not turn off a method whose steady steps pay, and it
    is counted in what a probe of a losing method costs."""
    policy = CostPolicy(min_samples=2, probe_interval=1000, probe_budget=1.0)
    in_run = False
    for _ in range(40):
        on = policy.should_propose("draft", 1)
        if on:
            policy.record({"draft"}, 1, 3, 1.2 if in_run else 6.0)  # 3 tokens a step: 2.5 tok/s vs 1
        else:
            policy.record(set(), 1, 1, 1.0)
        in_run = on
    state = policy.methods[("draft", 1)]
    assert state.winning and state.on.seconds == pytest.approx(1.2)
    assert state.first_step_extra_s == pytest.approx(4.8) and policy.probe_cost_s(state, policy.off[1]) > 0
    state.winning = False  # as if it lost: a probe would start a run and pay the catch-up again
    assert policy.probe_cost_s(state, policy.off[1]) >= state.first_step_extra_s


def test_methods_and_step_sizes_are_measured_apart():
    policy = CostPolicy(min_samples=3, probe_interval=1000)
    drive(policy, "draft", 1, 30, plain_s=1.0, spec_s=1.2, accepted_per_step=1.0)  # pays at 1 sequence
    drive(policy, "draft", 8, 30, plain_s=1.0, spec_s=2.0, accepted_per_step=1.0)  # loses at 8
    drive(policy, "prompt_lookup", 8, 30, plain_s=1.0, spec_s=1.05, accepted_per_step=2.0)  # pays at 8
    assert policy.methods[("draft", 1)].winning and not policy.methods[("draft", 8)].winning
    assert policy.methods[("prompt_lookup", 8)].winning
    assert policy.should_propose("draft", 1) and not policy.should_propose("draft", 8)
    # A step that ran two methods is charged to neither side.
    before = (policy.methods[("draft", 8)].on.num_samples, policy.methods[("prompt_lookup", 8)].on.num_samples,
              policy.off[8].num_samples)
    policy.record({"draft", "prompt_lookup"}, 8, 20, 0.1)
    assert (policy.methods[("draft", 8)].on.num_samples, policy.methods[("prompt_lookup", 8)].on.num_samples,
            policy.off[8].num_samples) == before
    assert [size_bucket(n) for n in (1, 8, 9, 16, 17, 33)] == [1, 8, 16, 16, 32, 64]
    assert any("draft at 8 seqs" in line and ", off," in line for line in policy.describe())


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="probe_interval"):
        CostPolicy(probe_interval=0)
    with pytest.raises(ValueError, match="smoothing"):
        CostPolicy(smoothing=0.0)
    with pytest.raises(ValueError, match="probe_budget"):
        CostPolicy(probe_budget=0.0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_step(speculator: Speculator, scheduler: Scheduler, clock: FakeClock, spec_s: float, plain_s: float) -> bool:
    """One engine step without a model: the target's argmax is always token 5, so every proposal
    (AlwaysProposer's 7s) is rejected; the step takes spec_s on the clock when it verified
    proposals, else plain_s. Returns whether it did."""
    speculator.begin_step()
    out = scheduler.schedule()
    speculator.plan(out, scheduler)
    logits = torch.zeros(sum(1 + s.num_draft_tokens for s in out.scheduled), 16)  # [rows, vocab]
    logits[:, 5] = 1.0
    scheduler.finish_step(out)
    for s, result in zip(out.scheduled, speculator.sample(logits, out.scheduled)):
        s.seq.token_ids.extend(result.token_ids)
        if s.draft is not None:
            scheduler.commit_drafts(s.seq, result.num_accepted)
    drafted = any(s.draft is not None for s in out.scheduled)
    clock.now += spec_s if drafted else plain_s
    speculator.end_step()
    return drafted


def test_the_speculator_measures_steps_with_its_clock_and_stops_a_losing_proposer():
    """Speculating steps take 3 s and keep nothing; plain ones take 1 s. After its warm-up the
    proposer is not even asked, and the greedy tokens are the target's either way."""
    clock = FakeClock()
    config = SpeculativeConfig(method="prompt_lookup", num_tokens=2, max_batch_tokens=0, adaptive=False)
    proposer = AlwaysProposer()
    speculator = Speculator(config, {"prompt_lookup": proposer}, clock=clock)
    assert speculator.cost is not None
    speculator.cost = CostPolicy(min_samples=2, probe_interval=1000)
    scheduler = Scheduler(PageManager(256, 16, enable_prefix_caching=False), 64, 2048)
    decoding_batch(2, scheduler)
    # 3 steps on (the first is measured apart), 2 off (warm-up), then off: a probe would lose
    # 4 x (3 s - 1 s) = 8 s, 400 s of plain steps at the 2% budget.
    drafted = [fake_step(speculator, scheduler, clock, spec_s=3.0, plain_s=1.0) for _ in range(12)]
    assert drafted == [True, True, True] + [False] * 9
    assert proposer.num_asked == 6  # 2 sequences x 3 warm-up steps
    assert speculator.cost.off[2].num_samples == 9 and speculator.cost.off[2].tokens_per_s == pytest.approx(2.0)
    assert speculator.cost.methods[("prompt_lookup", 2)].on.tokens_per_s == pytest.approx(2 / 3)
    assert all(seq.output_token_ids == [5] * 13 for seq in scheduler.running)  # the target's tokens


def test_a_step_with_a_prompt_chunk_is_not_measured():
    clock = FakeClock()
    speculator = Speculator(SpeculativeConfig(method="prompt_lookup"), {"prompt_lookup": AlwaysProposer()}, clock=clock)
    assert speculator.cost is not None
    scheduler = Scheduler(PageManager(256, 16, enable_prefix_caching=False), 64, 2048)
    decoding_batch(1, scheduler)
    scheduler.add(Sequence("new", [1, 2, 3], SamplingParams(max_tokens=4), 9, 512))  # a prompt to prefill
    fake_step(speculator, scheduler, clock, spec_s=3.0, plain_s=1.0)
    assert all(e.num_samples == 0 for e in speculator.cost.off.values())
    assert all(s.on.num_samples == 0 for s in speculator.cost.methods.values())
    fake_step(speculator, scheduler, clock, spec_s=3.0, plain_s=1.0)  # two decodes now: a run's first step
    fake_step(speculator, scheduler, clock, spec_s=3.0, plain_s=1.0)
    assert speculator.cost.methods[("prompt_lookup", 2)].on.num_samples == 1


def test_cost_policy_off_leaves_the_thresholds_alone():
    config = SpeculativeConfig(method="prompt_lookup", cost_policy=False, adaptive=False)
    speculator = Speculator(config, {"prompt_lookup": AlwaysProposer()})
    assert speculator.cost is None
    scheduler = Scheduler(PageManager(256, 16, enable_prefix_caching=False), 64, 2048)
    decoding_batch(2, scheduler)
    assert all(fake_step(speculator, scheduler, FakeClock(), spec_s=3.0, plain_s=1.0) for _ in range(12))


class PromptComputingProposer(AlwaysProposer):
    """Says that its `prompt_call`-th propose computed prompt tokens of its own KV (a draft's
    first catch-up of a request whose prompt it did not prefill, as on a decode worker)."""

    def __init__(self, prompt_call: int) -> None:
        super().__init__()
        self.prompt_call, self.num_calls = prompt_call, 0

    def propose(self, seqs, max_num_tokens):
        self.num_calls += 1
        self.computed_prompt = self.num_calls == self.prompt_call
        return super().propose(seqs, max_num_tokens)


def test_a_step_whose_proposer_computed_a_prompt_is_not_measured():
    """A cost once per request, not of the method's steps: charged to them in the middle of a run
    (where nothing keeps a run's first step apart), it turned off a draft that pays."""
    clock = FakeClock()
    speculator = Speculator(SpeculativeConfig(method="prompt_lookup", adaptive=False),
                            {"prompt_lookup": PromptComputingProposer(prompt_call=3)}, clock=clock)
    assert speculator.cost is not None
    scheduler = Scheduler(PageManager(256, 16, enable_prefix_caching=False), 64, 2048)
    decoding_batch(2, scheduler)
    for spec_s in (3.0, 3.0, 30.0, 3.0):  # a run's first step (apart), measured, the prompt's, measured
        assert fake_step(speculator, scheduler, clock, spec_s=spec_s, plain_s=1.0)
    state = speculator.cost.methods[("prompt_lookup", 2)]
    assert state.on.num_samples == 2 and state.on.seconds == pytest.approx(3.0)
    assert state.num_first_steps == 0 and state.in_run


class NeverProposer(AlwaysProposer):
    def propose(self, seqs, max_num_tokens):
        self.num_asked += len(seqs)
        return [Proposal(()) for _ in seqs]


def test_a_step_whose_proposer_found_nothing_is_not_measured():
    clock = FakeClock()
    proposer = NeverProposer()
    speculator = Speculator(SpeculativeConfig(method="prompt_lookup", adaptive=False), {"prompt_lookup": proposer},
                            clock=clock)
    assert speculator.cost is not None
    scheduler = Scheduler(PageManager(256, 16, enable_prefix_caching=False), 64, 2048)
    decoding_batch(2, scheduler)
    for _ in range(10):
        fake_step(speculator, scheduler, clock, spec_s=3.0, plain_s=1.0)
    assert proposer.num_asked == 20  # asked every step: never judged on steps it had nothing for
    assert speculator.cost.methods[("prompt_lookup", 2)].on.num_samples == 0 and speculator.cost.off[2].num_samples == 0


def test_a_seeded_request_proposes_whatever_the_policy_says():
    """Its draws depend on whether it proposed: a timing-driven choice would make it unrepeatable."""
    clock = FakeClock()
    speculator = Speculator(SpeculativeConfig(method="prompt_lookup", num_tokens=2, max_batch_tokens=0, adaptive=False),
                            {"prompt_lookup": AlwaysProposer()}, clock=clock)
    speculator.cost = CostPolicy(min_samples=1, probe_interval=1000)
    scheduler = Scheduler(PageManager(256, 16, enable_prefix_caching=False), 64, 2048)
    decoding_batch(2, scheduler)
    scheduler.running[0].params = SamplingParams(max_tokens=32, seed=3)
    for _ in range(6):
        fake_step(speculator, scheduler, clock, spec_s=3.0, plain_s=1.0)
    seeded, unseeded = scheduler.running
    assert seeded.spec is not None and unseeded.spec is not None
    assert seeded.spec.num_verified == 6 and unseeded.spec.num_verified == 2  # the warm-up steps only
