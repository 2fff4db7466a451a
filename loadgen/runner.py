"""`pdserve bench`: drive a running server with a seeded workload and report the field's metrics.

The flow, one module per step: a BenchPlan's workload becomes requests and send times
(bench_workloads.py); a backend sends them over gRPC or OpenAI HTTP and timestamps every
streamed chunk (bench_client.py); the records become a BenchResult written as JSON and CSV
(bench_results.py) and PNG plots (bench_plots.py). This module runs that flow once per rate
and prints the summaries; `bench compare` (bench_compare.py) runs it once per cluster config.

Arrivals: `throughput` is a burst (every request at t=0, optionally at most
`max_concurrency` in flight); every other workload uses Poisson (or, with burstiness != 1,
gamma) arrivals at each rate of the plan, where rate inf is a burst too.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from tqdm import tqdm

from loadgen.client import NO_OPTIONS, BaseBackend, RequestOptions, make_backend
from loadgen.credentials import NO_AUTH, ClientAuth
from loadgen.metrics import SLO, RequestRecord
from loadgen.results import BenchResult, BenchRun
from loadgen.workloads import (
    BenchRequest,
    WorkloadSpec,
    arrival_offsets,
    make_requests,
    spec_for_run,
    warmup_spec,
)


@dataclass(frozen=True)
class BenchPlan:
    """Everything that defines the traffic, so two systems can be sent exactly the same."""

    workload: WorkloadSpec
    rates: tuple[float, ...] = (math.inf,)
    burstiness: float = 1.0
    max_concurrency: int | None = None
    slo: SLO = field(default_factory=SLO)
    warmup_requests: int = 1  # sent and discarded first: one-time costs (first-call kernels) stay out
    options: RequestOptions = NO_OPTIONS  # what every request asks for besides its prompt and length

    def __post_init__(self) -> None:
        name = self.workload.name
        if not self.rates:
            raise ValueError("give at least one rate")
        if name == "throughput" and any(math.isfinite(r) for r in self.rates):
            raise ValueError("the throughput workload is a burst: drop --rate/--rates (cap it with --max-concurrency)")
        if name == "sweep" and sum(math.isfinite(r) for r in self.rates) < 2:
            raise ValueError("the sweep workload needs at least two finite rates (--rates 1,2,4)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")


async def run_load(backend: BaseBackend, requests: list[BenchRequest], offsets: list[float],
                   max_concurrency: int | None = None, progress: bool = False) -> tuple[list[RequestRecord], float]:
    """Sends request i at start + offsets[i] (waiting for a free slot under max_concurrency) and
    returns the records in request order and the time from start until the last one ended.
    A request's arrival is when it is actually sent, so a concurrency cap's client-side wait is
    not counted as server latency."""
    slots = asyncio.Semaphore(max_concurrency or len(requests))
    bar = tqdm(total=len(requests), disable=not progress, unit="req", file=sys.stderr, leave=False)
    start = time.perf_counter()

    async def fire(request: BenchRequest, offset: float) -> RequestRecord:
        # Sleep to an absolute send time (not gap by gap), so scheduling delays never accumulate.
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        async with slots:
            record = await backend.send(request, time.perf_counter())
        bar.update(1)
        return record

    try:
        records = await asyncio.gather(*(fire(r, o) for r, o in zip(requests, offsets)))
    finally:
        bar.close()
    return list(records), time.perf_counter() - start


async def _run_all(backend: BaseBackend, plan: BenchPlan, progress: bool, say: Callable[[str], None]
                   ) -> list[BenchRun]:
    runs = []
    async with backend:
        if plan.warmup_requests:
            await run_load(backend, make_requests(warmup_spec(plan.workload, plan.warmup_requests)),
                           [0.0] * plan.warmup_requests)
        for i, rate in enumerate(plan.rates):
            requests = make_requests(spec_for_run(plan.workload, i))
            # One arrival stream per rate, seeded apart from the requests' own seed.
            offsets = arrival_offsets(len(requests), rate, plan.burstiness, seed=plan.workload.seed + 1 + i)
            records, duration_s = await run_load(backend, requests, offsets, plan.max_concurrency, progress)
            runs.append(BenchRun(rate, duration_s, tuple(records)))
            say(format_run(runs[-1], plan))
    return runs


def run_bench(backend_kind: str, address: str, plan: BenchPlan, label: str, model: str | None = None,
              progress: bool = True, say: Callable[[str], None] = print, auth: ClientAuth = NO_AUTH
              ) -> BenchResult:
    """Runs the plan against one server, one rate after another (each rate on fresh prompts of
    the same shape; every server given the same plan gets the same prompts at the same times);
    `auth`: the API key and TLS settings of a secured server."""
    backend = make_backend(backend_kind, address, model, auth, plan.options)
    runs = asyncio.run(_run_all(backend, plan, progress, say))
    result = BenchResult(label, backend_kind, address, asdict(plan.workload), plan.slo, plan.burstiness,
                         plan.max_concurrency, tuple(runs))
    best = result.max_rate_at_attainment()
    if not math.isnan(best):
        say(f"{label}: highest rate with >= 90% SLO attainment: {best:.2f} req/s (interpolated)")
    return result


def _ms(stats: dict[str, float]) -> str:
    return " ".join(f"{k}={1000 * v:.1f}ms" for k, v in stats.items())


def format_run(run: BenchRun, plan: BenchPlan) -> str:
    s = run.summary(plan.slo)
    rate = "burst" if math.isinf(run.rate) else f"{run.rate:g} req/s"
    lines = [(f"{plan.workload.name} @ {rate}: {s.num_requests} requests ({s.num_failed} failed) in "
              f"{s.duration_s:.2f} s | {s.request_throughput:.2f} req/s, {s.output_token_throughput:.1f} output tok/s")]
    lines += [f"  {name.upper():5s} {_ms(getattr(s, name))}" for name in ("ttft", "tpot", "itl", "e2e")]
    if s.stages:  # the server's own account (pdserve): TTFT = queued + prefill; the KV hand-off after it
        lines.append("  stages (mean) " + ", ".join(f"{stage} {1000 * v['mean']:.1f}ms" for stage, v in s.stages.items()))
    kinds = run.kinds()
    if len(kinds) > 1:
        for kind in kinds:
            k = run.summary_of_kind(kind)
            lines.append(f"  {kind}: {k.num_requests} requests, TTFT p99 {1000 * k.ttft['p99']:.1f}ms, "
                         f"TPOT p99 {1000 * k.tpot['p99']:.1f}ms")
    if not math.isnan(s.attainment):
        lines.append(f"  goodput {s.goodput:.2f} req/s, SLO attainment {s.attainment:.0%}")
    errors = sorted({r.error for r in run.records if not r.ok})
    if errors:
        lines.append(f"  errors: {', '.join(errors)}")
    return "\n".join(lines)
