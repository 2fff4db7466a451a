"""`pdserve advise`'s table: every layout's predicted goodput on every rate of a recorded
workload (simulator.py), its SLO attainment and TTFT/TPOT percentiles, the recommendation (the
highest goodput summed over the rates; a tie goes to the layout listed first), and, given measured
`pdserve bench` results of the same layouts, the prediction's error against each."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from cluster.advise.costs import Costs
from cluster.advise.simulator import Layout, Prediction, Request, simulate
from loadgen.metrics import SLO
from loadgen.results import BenchResult


@dataclass(frozen=True)
class Workload:
    """One request stream per rate, as a `pdserve bench` result recorded it."""

    name: str
    runs: tuple[tuple[float, tuple[Request, ...]], ...]  # (rate, requests)

    @classmethod
    def of(cls, result: BenchResult) -> Workload:
        """The result's streams; with their prompts' token ids where the seeded workload it names
        regenerates them (loadgen/workloads.py), so prefix-cache hits can be modelled."""
        prompts = _prompts(result.workload)
        runs = []
        for run in result.runs:
            start = min((r.arrival for r in run.records), default=0.0)
            known = prompts if prompts and [len(p) for p in prompts] == [r.prompt_tokens for r in run.records] \
                else [None] * len(run.records)
            runs.append((run.rate, tuple(Request(r.arrival - start, max(1, r.prompt_tokens), max(1, r.num_tokens), p)
                                         for r, p in zip(run.records, known, strict=True))))
        return cls(result.label, tuple(runs))


def _prompts(workload: dict) -> list[tuple[int, ...]] | None:
    from loadgen.workloads import LengthDist, WorkloadSpec, make_requests

    try:
        spec = WorkloadSpec(**{**workload, "input_len": LengthDist(**workload["input_len"]),
                               "output_len": LengthDist(**workload["output_len"])})
        return [r.prompt for r in make_requests(spec)]
    except (KeyError, TypeError, ValueError):
        return None  # not a pdserve workload spec: lengths only


@dataclass(frozen=True)
class Advice:
    predictions: dict[tuple[str, float], Prediction]  # (layout, rate) -> prediction
    layouts: tuple[str, ...]
    rates: tuple[float, ...]

    @property
    def recommended(self) -> str:
        return max(self.layouts, key=lambda name: (sum(_finite(self.predictions[name, r].summary.goodput)
                                                       for r in self.rates), -self.layouts.index(name)))


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0


def advise(layouts: Sequence[Layout], costs: Costs, workload: Workload, slo: SLO) -> Advice:
    predictions = {(layout.name, rate): simulate(layout, costs, requests, slo)
                   for layout in layouts for rate, requests in workload.runs}
    return Advice(predictions, tuple(layout.name for layout in layouts), tuple(rate for rate, _ in workload.runs))


def _rate(rate: float) -> str:
    return "burst" if math.isinf(rate) else f"{rate:g}/s"


def _pct(d: dict) -> str:
    return "/".join(f"{d.get(p, math.nan) * 1e3:.0f}" for p in ("p50", "p90", "p99"))


def lines(advice: Advice, measured: dict[str, BenchResult] | None = None, slo: SLO | None = None) -> Iterator[str]:
    measured = measured or {}
    yield (f"  {'layout':<24} {'rate':>6} {'goodput':>8} {'attain':>7} {'TTFT p50/p90/p99 ms':>20} "
           f"{'TPOT p50/p90/p99 ms':>20}" + (f" {'measured':>9} {'error':>7}" if measured else ""))
    for name in advice.layouts:
        for rate in advice.rates:
            s = advice.predictions[name, rate].summary
            row = (f"  {name:<24} {_rate(rate):>6} {s.goodput:>8.3f} {s.attainment:>7.0%} {_pct(s.ttft):>20} "
                   f"{_pct(s.tpot):>20}")
            result = measured.get(name)
            if result is not None:
                run = next((r for r in result.runs if r.rate == rate or (math.isinf(r.rate) and math.isinf(rate))), None)
                if run is not None:
                    real = run.summary(slo).goodput
                    error = (s.goodput - real) / real if real > 0 else math.nan
                    row += f" {real:>9.3f} {error:>+7.0%}"
            yield row
    yield f"  recommended: {advice.recommended} (highest predicted goodput over the rates)"
