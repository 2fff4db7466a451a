"""The layout simulator of `pdserve advise` (cluster/advise/simulator.py) on cases worked out
by hand: chunked prefill, decode steps, a queue behind one prefill worker, the KV link, cores
shared by more workers than there are, and the adaptive rule placing a prompt locally when the
prefill queue makes that faster."""

from __future__ import annotations

import pytest

from cluster.advise.costs import Costs, LinkCost, StepCost
from cluster.advise.simulator import Layout, Request, Simulation, WorkerShape, simulate
from loadgen.metrics import SLO

STEP = StepCost(fixed_s=0.01, per_prompt_token_s=0.001, per_sequence_s=0.0)
COSTS = Costs("test", {1: STEP, 2: StepCost(0.005, 0.0005, 0.0)}, kv_bytes_per_token=0, link=LinkCost(0.005, 0.0))


def colocated(threads: int = 1, budget: int = 512, cores: int = 1) -> Layout:
    return Layout("colocated", (WorkerShape("colocated", threads, budget),), cores)


def p1d1(disaggregation: str = "always", cores: int = 2) -> Layout:
    return Layout("1P1D", (WorkerShape("prefill", 1, 512), WorkerShape("decode", 1, 512)), cores, disaggregation)


def times(layout: Layout, requests: list[Request], costs: Costs = COSTS) -> list[list[float]]:
    return [[round(t, 6) for t in r.token_times] for r in Simulation(layout, costs, SLO()).run(requests)]


def test_one_request_on_a_colocated_worker_prefills_then_decodes_a_token_a_step():
    # prefill: 0.01 + 100 x 0.001 = 0.11; then 4 decode steps of 0.01 each
    assert times(colocated(), [Request(0.0, 100, 5)]) == [[0.11, 0.12, 0.13, 0.14, 0.15]]
    # two threads: the profiled 2-thread costs
    assert times(colocated(threads=2, cores=2), [Request(0.0, 100, 2)]) == [[0.055, 0.06]]


def test_a_prompt_over_the_budget_is_prefilled_in_chunks():
    # 1000 tokens at a budget of 512: steps of 0.01 + 0.512 and 0.01 + 0.488
    assert times(colocated(), [Request(0.0, 1000, 1)]) == [[1.02]]


def test_a_decode_sequence_shares_the_step_of_a_later_prompt():
    # B arrives at 0.05, while A's prefill step (to 0.11) runs; the next step carries A's first
    # decode and B's 50-token prefill: 0.01 + 0.05 = 0.06, so both have a token at 0.17.
    a, b = times(colocated(), [Request(0.0, 100, 3), Request(0.05, 50, 2)])
    assert a == [0.11, 0.17, 0.18] and b == [0.17, 0.18]


def test_disaggregated_prompts_queue_on_the_prefill_worker_and_cross_the_link():
    # A's prefill step starts as it arrives (0.11); B, arriving next, waits for it (0.22). Each
    # KV then crosses the link (latency 0.005) and decodes in the decode worker's next step (0.01).
    a, b = times(p1d1(), [Request(0.0, 100, 2), Request(0.0, 100, 2)])
    assert a == [0.11, 0.125] and b == [0.22, 0.235]
    # A measured bandwidth: the KV's last chunk (100 tokens x 100 bytes) takes 0.01 s more.
    slow = Costs("test", {1: STEP}, kv_bytes_per_token=100, link=LinkCost(0.005, 1e6))
    assert times(p1d1(), [Request(0.0, 100, 2)], slow) == [[0.11, 0.135]]


def test_more_busy_workers_than_cores_stretch_every_step():
    # Both workers busy from the start on one core: the prefill step counts 2 busy -> x2.
    a, = times(p1d1(cores=1), [Request(0.0, 100, 1)])
    assert a == [0.11]  # the decode worker had nothing to do: one busy worker
    two = times(Layout("2C", (WorkerShape("colocated", 1, 512), WorkerShape("colocated", 1, 512)), 1),
                [Request(0.0, 100, 1), Request(0.0, 100, 1)])
    assert two == [[0.11], [0.22]]  # the first starts alone (1 busy), the second with it busy (x2)


def test_adaptive_places_a_prompt_locally_when_the_prefill_queue_is_long():
    requests = [Request(0.0, 4000, 1), Request(0.001, 20, 4)]
    layout = p1d1("adaptive")
    sim = Simulation(layout, COSTS, SLO(2.0, 0.15))
    short = sim.run(requests)[1]
    assert sim.placements == {"remote": 1, "local": 1}
    assert short.token_times[0] == pytest.approx(0.001 + 0.01 + 0.02)  # computed on the idle decode worker
    always = Simulation(p1d1("always"), COSTS, SLO(2.0, 0.15))
    assert always.run(requests)[1].token_times[0] > 4.0  # behind the long prompt
    assert always.placements == {"remote": 2}


def test_goodput_counts_the_requests_meeting_both_targets():
    requests = [Request(0.0, 100, 5), Request(1.0, 3000, 5)]  # the second's TTFT is over 3 s
    pred = simulate(colocated(), COSTS, requests, SLO(ttft_s=1.0, tpot_s=0.1))
    assert pred.summary.attainment == 0.5 and pred.summary.num_requests == 2
    with pytest.raises(ValueError, match="no requests"):
        simulate(colocated(), COSTS, [], SLO())


def test_a_prompt_behind_another_with_its_prefix_computes_only_its_suffix():
    # page size 16: B shares A's first 96 tokens (6 pages). A's step: 0.01 + 0.1 = 0.11; B,
    # scheduled after A cached its pages, computes 104 - 96 = 8 tokens: 0.01 + 0.008.
    shared = tuple(range(96))
    a, b = Request(0.0, 100, 1, shared + (1000, 1001, 1002, 1003)), Request(0.0, 104, 1, shared + tuple(range(500, 508)))
    assert times(colocated(), [a, b]) == [[0.11], [0.128]]
    # Token ids unknown: no hits.
    assert times(colocated(), [Request(0.0, 100, 1), Request(0.0, 104, 1)]) == [[0.11], [0.224]]


def test_a_long_chunk_costs_its_square_term():
    step = StepCost(0.01, 0.001, 0.0, per_prompt_token2_s=1e-6)
    assert step.step_s(1000, 0) == pytest.approx(0.01 + 1.0 + 1.0)
    with pytest.raises(ValueError, match="negative"):
        StepCost(0.01, -0.001, 0.0)
