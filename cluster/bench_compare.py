"""`pdserve bench compare`: the same traffic against several cluster configs, one after another.

For each config: bring the cluster up with the launcher (as `pdserve up` does), run the
BenchPlan against its router (cluster/bench.py), bring it down (every actor and the embedded
Ray, so nothing is left behind and the next config gets the machine to itself), and write the
result labelled by the config's file name. Then overlay plots of all of them and a table of
each config's metrics with ratios against the first config at the same rate: ratios measured
side by side in one invocation are what a shared, noisy machine can report (DESIGN.md §6).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cluster.bench import BenchPlan, run_bench
from cluster.bench_metrics import SLO, summarize
from cluster.bench_plots import plot_results
from cluster.bench_results import BenchResult, BenchRun, write_result

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


def target_address(config, grpc_address: str, backend: str) -> str:
    """Where the bench backend reaches the cluster `launcher.up` started."""
    if backend == "grpc":
        return grpc_address
    if config.router.http_port is None:
        raise ValueError("--backend openai needs router.http_port set in every compared config")
    return f"http://{grpc_address.rsplit(':', 1)[0]}:{config.router.http_port}"


def run_compare(config_paths: list[Path], plan: BenchPlan, backend: str, out_dir: Path, timeout_s: float = 300.0,
                progress: bool = True, say: Callable[[str], None] = print) -> list[BenchResult]:
    from cluster import launcher
    from configs import load_cluster_config

    configs = [load_cluster_config(p) for p in config_paths]  # every config checked before any cluster starts
    labels = [p.stem for p in config_paths]
    if len(set(labels)) != len(labels):
        raise ValueError(f"config file names must differ (they label the results): {labels}")
    results = []
    for path, config, label in zip(config_paths, configs, labels):
        say(f"== {label}: starting the cluster from {path}")
        cluster = launcher.up(config, timeout_s=timeout_s, say=say)
        try:
            result = run_bench(backend, target_address(config, cluster.grpc_address, backend), plan, label,
                               progress=progress, say=say)
        finally:
            cluster.shutdown()
            say(f"== {label}: cluster stopped")
        json_path, _ = write_result(result, out_dir)
        say(f"   wrote {json_path} and its .csv")
        results.append(result)
    for png in plot_results(results, out_dir):
        say(f"   wrote {png}")
    table = format_table(comparison_rows(results))
    (out_dir / "compare.md").write_text(table + "\n")
    say("\n" + table)
    return results
