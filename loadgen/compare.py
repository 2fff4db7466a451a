"""The ratio table of several bench results: each config's metrics at each rate, against the
first config at the same rate. Ratios measured side by side in one invocation are what a
shared, noisy machine can report. Used by `pdserve bench compare` (cluster/bench_compare.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from loadgen.metrics import SLO, summarize
from loadgen.results import BenchResult, BenchRun

SHORT_KIND = "short"  # the mixed workload's short requests: the ones long prefills interfere with


@dataclass(frozen=True)
class Metric:
    key: str
    header: str
    unit: str  # "ms" values are stored in seconds and shown in milliseconds
    value: Callable[[BenchRun, SLO], float]


def _short_tpot_p99(run: BenchRun, slo: SLO) -> float:
    return summarize([r.tpot for r in run.records if r.kind == SHORT_KIND and r.ok and r.tpot is not None])["p99"]


METRICS = (
    Metric("request_throughput", "req/s", "", lambda run, slo: run.summary(slo).request_throughput),
    Metric("output_token_throughput", "out tok/s", "", lambda run, slo: run.summary(slo).output_token_throughput),
    Metric("ttft_p50", "TTFT p50", "ms", lambda run, slo: run.summary(slo).ttft["p50"]),
    Metric("ttft_p99", "TTFT p99", "ms", lambda run, slo: run.summary(slo).ttft["p99"]),
    Metric("tpot_p50", "TPOT p50", "ms", lambda run, slo: run.summary(slo).tpot["p50"]),
    Metric("tpot_p99", "TPOT p99", "ms", lambda run, slo: run.summary(slo).tpot["p99"]),
    Metric("short_tpot_p99", "short TPOT p99", "ms", _short_tpot_p99),
    Metric("goodput", "goodput req/s", "", lambda run, slo: run.summary(slo).goodput),
    Metric("attainment", "SLO attainment", "%", lambda run, slo: run.summary(slo).attainment),
)


@dataclass(frozen=True)
class CompareRow:
    label: str
    rate: float
    values: dict[str, float]
    ratios: dict[str, float]  # value / the first result's value at the same rate (NaN if undefined)


def comparison_rows(results: list[BenchResult]) -> list[CompareRow]:
    """One row per (result, rate), rates in the order they ran; results must share their rates."""
    if not results:
        return []
    base = results[0]
    rows = []
    for result in results:
        if [r.rate for r in result.runs] != [r.rate for r in base.runs]:
            raise ValueError(f"{result.label} ran at other rates than {base.label}: results are not comparable")
        for run, base_run in zip(result.runs, base.runs):
            values = {m.key: m.value(run, result.slo) for m in METRICS}
            base_values = {m.key: m.value(base_run, base.slo) for m in METRICS}
            ratios = {k: v / base_values[k] if base_values[k] and not math.isnan(base_values[k]) else math.nan
                      for k, v in values.items()}
            rows.append(CompareRow(result.label, run.rate, values, ratios))
    return rows


def _cell(metric: Metric, value: float, ratio: float, show_ratio: bool) -> str:
    if math.isnan(value):
        return "-"
    text = {"ms": f"{1000 * value:.1f} ms", "%": f"{value:.0%}"}.get(metric.unit, f"{value:.2f}")
    return f"{text} ({ratio:.2f}x)" if show_ratio and not math.isnan(ratio) else text


def format_table(rows: list[CompareRow]) -> str:
    """A Markdown table; metrics that no row has (e.g. goodput without an SLO) are left out."""
    metrics = [m for m in METRICS if any(not math.isnan(row.values[m.key]) for row in rows)]
    base_label = rows[0].label if rows else ""
    lines = ["| config | rate | " + " | ".join(m.header for m in metrics) + " |",
             "|---|---|" + "---|" * len(metrics)]
    for row in rows:
        rate = "burst" if math.isinf(row.rate) else f"{row.rate:g} req/s"
        cells = [_cell(m, row.values[m.key], row.ratios[m.key], row.label != base_label) for m in metrics]
        lines.append(f"| {row.label} | {rate} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n\n(ratios in parentheses: against {base_label} at the same rate)"
