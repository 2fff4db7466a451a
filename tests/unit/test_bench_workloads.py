"""Bench workload generators and the arrival process: seeded, shaped as documented, and with
the distributions' bounds and means."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from loadgen.runner import BenchPlan
from loadgen.workloads import (
    EXPONENTIAL_CAP,
    LengthDist,
    WorkloadSpec,
    arrival_offsets,
    make_requests,
    spec_for_run,
    warmup_spec,
)


def spec(name="fixed", num=200, input_len=None, output_len=None, **kw) -> WorkloadSpec:
    return WorkloadSpec(name, num, input_len or LengthDist(32), output_len or LengthDist(8), **kw)


def test_same_seed_same_requests_other_seed_other_tokens():
    for name in ("fixed", "mixed", "prefix", "throughput", "sweep"):
        a = make_requests(spec(name, seed=3))
        assert a == make_requests(spec(name, seed=3))
        assert [r.prompt for r in a] != [r.prompt for r in make_requests(spec(name, seed=4))]
    # A sweep's later rates get fresh prompts of the same shape (no prefix-cache carry-over).
    first, second = make_requests(spec_for_run(spec("mixed"), 0)), make_requests(spec_for_run(spec("mixed"), 1))
    assert first == make_requests(spec("mixed")) and {r.prompt for r in first}.isdisjoint(r.prompt for r in second)
    assert {r.prompt for r in make_requests(warmup_spec(spec(), 2))}.isdisjoint(r.prompt for r in first)


def test_fixed_lengths_token_range_and_bos():
    reqs = make_requests(spec("fixed", num=50, vocab_size=100))
    assert all(len(r.prompt) == 32 and r.output_len == 8 and r.kind == "fixed" for r in reqs)
    assert all(r.prompt[0] == 0 and all(3 <= t < 100 for t in r.prompt[1:]) for r in reqs)


def test_mixed_is_mostly_short_with_long_prompts_of_the_given_factor():
    reqs = make_requests(spec("mixed", num=1000, long_fraction=0.2, long_factor=8))
    long = [r for r in reqs if r.kind == "long"]
    assert {len(r.prompt) for r in long} == {256} and {len(r.prompt) for r in reqs if r.kind == "short"} == {32}
    assert 0.16 < len(long) / len(reqs) < 0.24  # binomial(1000, 0.2): sd ~0.013


def test_prefix_shares_prefixes_and_the_control_does_not():
    shared = make_requests(spec("prefix", num=40, num_prefixes=3, suffix_len=5))
    assert len({r.prompt[:32] for r in shared}) == 3 and len({r.prompt for r in shared}) == 40
    assert all(len(r.prompt) == 37 and r.kind == "shared" for r in shared)
    control = make_requests(spec("prefix", num=40, num_prefixes=0, suffix_len=5))
    assert len({r.prompt[:32] for r in control}) == 40
    assert all(len(r.prompt) == 37 and r.kind == "unshared" for r in control)


@pytest.mark.parametrize(("dist", "lo", "hi"), [(LengthDist(100, "uniform", 0.5), 50, 150),
                                                (LengthDist(100, "exponential"), 1, 100 * EXPONENTIAL_CAP),
                                                (LengthDist(100), 100, 100)])
def test_length_distributions_bounds_and_means(dist, lo, hi):
    rng = random.Random(0)
    draws = [dist.sample(rng) for _ in range(20000)]
    assert dist.bounds == (lo, hi) and min(draws) >= lo and max(draws) <= hi
    assert all(isinstance(n, int) for n in draws)
    # Clipping at 4x the mean removes E[X - 4m | X > 4m] P(X > 4m) = m e^-4 from the mean.
    expected = 100 * (1 - math.exp(-EXPONENTIAL_CAP)) if dist.kind == "exponential" else 100
    assert statistics.fmean(draws) == pytest.approx(expected, rel=0.03)
    if dist.kind == "uniform":
        assert min(draws) == 50 and max(draws) == 150  # both ends are reachable


def test_output_lengths_follow_their_distribution():
    reqs = make_requests(spec("fixed", num=500, output_len=LengthDist(20, "uniform", 0.5)))
    lengths = [r.output_len for r in reqs]
    assert 10 <= min(lengths) and max(lengths) <= 30 and len(set(lengths)) > 10


def test_bad_specs_are_rejected_with_the_reason():
    with pytest.raises(ValueError, match="unknown length distribution"):
        LengthDist(10, "normal")
    with pytest.raises(ValueError, match="range ratio"):
        LengthDist(10, "uniform", 1.5)
    with pytest.raises(ValueError, match="unknown workload"):
        spec("bursty")


def test_poisson_arrivals_have_the_rate_and_exponential_gaps():
    offsets = arrival_offsets(20000, rate=4.0, seed=1)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.05)  # CV of exponential
    assert offsets == arrival_offsets(20000, rate=4.0, seed=1)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_keeps_the_rate_and_sets_the_spread(burstiness):
    offsets = arrival_offsets(20000, rate=2.0, burstiness=burstiness, seed=2)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert statistics.fmean(gaps) == pytest.approx(0.5, rel=0.05)
    # Gamma(k) has coefficient of variation 1/sqrt(k): burstier below 1, steadier above.
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)


def test_burst_and_bad_rates():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    with pytest.raises(ValueError, match="rate"):
        arrival_offsets(5, 0.0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_offsets(5, 1.0, burstiness=0)


def test_plan_checks_the_workload_against_its_arrivals():
    BenchPlan(spec("throughput"), max_concurrency=4)
    with pytest.raises(ValueError, match="burst"):
        BenchPlan(spec("throughput"), rates=(2.0,))
    with pytest.raises(ValueError, match="two finite rates"):
        BenchPlan(spec("sweep"), rates=(2.0,))
    BenchPlan(spec("sweep"), rates=(1.0, 2.0), burstiness=0.5)


def test_cli_builds_the_plan_and_names_bad_combinations(capsys):
    from cluster.cli import build_parser, main
    from cluster.cmd_bench import bench_plan

    args = build_parser().parse_args(["bench", "--address", "x:1", "--workload", "sweep", "--rates", "1,2.5",
                                      "--input-dist", "exponential", "--burstiness", "0.5", "--slo-tpot", "0.1"])
    plan = bench_plan(args)
    assert plan.rates == (1.0, 2.5) and plan.burstiness == 0.5 and plan.slo.tpot_s == 0.1
    assert plan.workload.input_len == LengthDist(128, "exponential")
    assert main(["bench", "--address", "x:1", "--workload", "sweep", "--rate", "2"]) == 2
    assert "at least two finite rates" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--rates", "1,-2"])


def test_bench_requests_carry_the_speculative_flags():
    from cluster.cli import build_parser
    from cluster.cmd_bench import bench_plan
    from loadgen.client import RequestOptions
    from proto import pdserve_pb2 as pb

    args = build_parser().parse_args(["bench", "--address", "x:1", "--speculative-method", "draft",
                                      "--num-speculative-tokens", "3"])
    options = bench_plan(args).options
    assert options == RequestOptions("draft", 3)
    assert options.body_fields() == {"speculative_method": "draft", "num_speculative_tokens": 3}
    sampling = pb.SamplingParams(max_tokens=4, **options.body_fields())
    assert (sampling.speculative_method, sampling.num_speculative_tokens) == ("draft", 3)
    unset = bench_plan(build_parser().parse_args(["bench", "--address", "x:1"])).options
    assert unset.body_fields() == {}  # the pool's setting applies
    assert not pb.SamplingParams(max_tokens=4, **unset.body_fields()).HasField("speculative_method")
    for bad in (["--speculative-method", "eagle"], ["--num-speculative-tokens", "17"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "--address", "x:1", *bad])
