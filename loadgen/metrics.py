"""Serving metrics over per-request timelines, as the field defines them (pure functions).

Used by `pdserve bench` on the timestamps it records for each request. TTFT = first token -
arrival; E2E = last token - arrival; TPOT = (E2E - TTFT) / (tokens - 1); ITL = gaps between
consecutive tokens; goodput = requests per second that meet every SLO; attainment = the share
that does. Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestRecord:
    arrival: float
    token_times: tuple[float, ...]  # when each token (or streamed chunk's last token) arrived
    num_tokens: int
    prompt_tokens: int
    ok: bool = True
    error: str = ""
    kind: str = ""  # the workload's request class ("short"/"long" in mixed), for per-class percentiles
    # The server's own account of the request's stages (pdserve's Usage; empty for other servers):
    # {stage: seconds}, proto/usage_stages.py STAGES.
    stages: dict[str, float] = field(default_factory=dict)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return self.token_times[-1] - self.arrival if self.token_times else None

    @property
    def tpot(self) -> float | None:
        if self.num_tokens < 2 or not self.token_times:
            return None
        return (self.e2e - self.ttft) / (self.num_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def percentile(values: Sequence[float], p: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * p / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {k: math.nan for k in ("mean", "p50", "p90", "p95", "p99")}
    return {"mean": sum(values) / len(values), **{f"p{p}": percentile(values, p) for p in (50, 90, 95, 99)}}


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None
    tpot_s: float | None = None

    def is_set(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None

    def scaled(self, factor: float) -> SLO:
        """Both targets times `factor`: attainment against a looser (> 1) or tighter (< 1) SLO."""
        return SLO(None if self.ttft_s is None else self.ttft_s * factor,
                   None if self.tpot_s is None else self.tpot_s * factor)

    def met_by(self, r: RequestRecord) -> bool:
        if not r.ok or r.ttft is None:
            return False
        if self.ttft_s is not None and r.ttft > self.ttft_s:
            return False
        return not (self.tpot_s is not None and r.tpot is not None and r.tpot > self.tpot_s)


@dataclass
class Summary:
    num_requests: int
    num_failed: int
    duration_s: float
    request_throughput: float
    output_token_throughput: float
    ttft: dict[str, float] = field(default_factory=dict)
    tpot: dict[str, float] = field(default_factory=dict)
    itl: dict[str, float] = field(default_factory=dict)
    e2e: dict[str, float] = field(default_factory=dict)
    goodput: float = math.nan
    attainment: float = math.nan
    # {stage: summarize(...)} over the requests whose server reported it (pdserve: RequestRecord.stages)
    stages: dict[str, dict[str, float]] = field(default_factory=dict)


def summarize_run(records: Sequence[RequestRecord], duration_s: float, slo: SLO | None = None) -> Summary:
    ok = [r for r in records if r.ok and r.token_times]
    out = Summary(
        num_requests=len(records), num_failed=len(records) - len(ok), duration_s=duration_s,
        request_throughput=len(ok) / duration_s if duration_s > 0 else math.nan,
        output_token_throughput=sum(r.num_tokens for r in ok) / duration_s if duration_s > 0 else math.nan,
        ttft=summarize([r.ttft for r in ok]), tpot=summarize([r.tpot for r in ok if r.tpot is not None]),
        itl=summarize([g for r in ok for g in r.itls]), e2e=summarize([r.e2e for r in ok]),
        stages={stage: summarize(values) for stage, values in _stage_values(ok).items()},
    )
    if slo is not None and slo.is_set() and records:
        met = sum(1 for r in records if slo.met_by(r))
        out.goodput = met / duration_s if duration_s > 0 else math.nan
        out.attainment = met / len(records)
    return out


def _stage_values(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    values: dict[str, list[float]] = {}
    for r in records:
        for stage, seconds in r.stages.items():
            values.setdefault(stage, []).append(seconds)
    return values


def max_rate_at_attainment(rates: Sequence[float], attainments: Sequence[float], target: float = 0.9) -> float:
    """The highest request rate keeping attainment >= target, interpolated linearly between the
    last swept rate that meets it and the next that does not (NaN if even the lowest fails)."""
    points = sorted(zip(rates, attainments))
    best = math.nan
    for (r0, a0), (r1, a1) in zip(points, points[1:] + [(math.inf, -math.inf)]):
        if a0 < target:
            break
        best = r0
        if a1 < target and math.isfinite(r1):
            return r0 + (r1 - r0) * (a0 - target) / (a0 - a1)
    return best
