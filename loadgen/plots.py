"""PNG charts of bench results, one line per system or configuration so runs overlay.

Read side of a bench run: `pdserve bench` plots its own result, `bench plot` and `bench
compare` overlay several (loadgen/results.py loads them). Four charts:
- latency CDFs: TTFT, TPOT, ITL and E2E, one panel each, one line per (result, rate);
- SLO attainment versus request rate: one line per result that swept several rates;
- SLO attainment versus an SLO scale factor: both targets times 0.5..3, one line per
  (result, rate): how much looser the SLO must be for a system to meet it;
- request stages: a stacked bar per (result, rate) of the stages pdserve reports in its usage.
Each `*_figure` function returns a matplotlib Figure (tests inspect its lines); figures are
drawn on the Agg canvas directly, without pyplot's global state, so no display is needed.
"""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from loadgen.results import ATTAINMENT_TARGET, BenchResult, BenchRun
from proto.usage_stages import STAGES

SLO_SCALES = tuple(0.5 + 0.1 * i for i in range(26))  # 0.5x .. 3.0x
METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E"))
LINESTYLES = ("-", "--", ":", "-.")


def _style(result_index: int, run_index: int) -> dict:
    """One colour per result (system), one dash pattern per rate: systems stay easy to tell apart."""
    return {"color": f"C{result_index % 10}", "linestyle": LINESTYLES[run_index % len(LINESTYLES)]}


def run_label(result: BenchResult, run: BenchRun) -> str:
    """The result's label, plus the rate when the result has several runs."""
    if len(result.runs) == 1:
        return result.label
    return f"{result.label} @ {'burst' if math.isinf(run.rate) else f'{run.rate:g} req/s'}"


def latency_values(run: BenchRun, metric: str) -> list[float]:
    ok = [r for r in run.records if r.ok and r.token_times]
    if metric == "itl":
        return [gap for r in ok for gap in r.itls]
    return [v for v in (getattr(r, metric) for r in ok) if v is not None]


def _new_figure(rows: int = 1, cols: int = 1, size: tuple[float, float] = (7, 4.5)) -> tuple[Figure, list]:
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def latency_cdf_figure(results: list[BenchResult]) -> Figure:
    fig, axes = _new_figure(2, 2, (11, 8))
    for ax, (metric, title) in zip(axes, METRICS):
        for i, result in enumerate(results):
            for j, run in enumerate(result.runs):
                values = sorted(latency_values(run, metric))
                if values:
                    ax.step([1000 * v for v in values], [(k + 1) / len(values) for k in range(len(values))],
                            where="post", label=run_label(result, run), **_style(i, j))
        ax.set(title=f"{title} CDF", xlabel=f"{title} (ms)", ylabel="fraction of requests" if metric != "itl"
               else "fraction of token gaps", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
    return fig


def attainment_vs_rate_figure(results: list[BenchResult]) -> Figure | None:
    """None when no result swept at least two finite rates with an SLO set."""
    fig, (ax,) = _new_figure()
    for i, result in enumerate(results):
        swept = sorted((run for run in result.runs if math.isfinite(run.rate)), key=lambda run: run.rate)
        if len(swept) < 2 or not result.slo.is_set():
            continue
        ax.plot([run.rate for run in swept], [run.summary(result.slo).attainment for run in swept], marker="o",
                label=result.label, **_style(i, 0))
    return _attainment_axes(fig, ax, f"SLO attainment vs request rate ({_slo_text(results)})", "request rate (req/s)")


def attainment_vs_slo_scale_figure(results: list[BenchResult], scales: tuple[float, ...] = SLO_SCALES
                                   ) -> Figure | None:
    """None when no result has an SLO to scale."""
    fig, (ax,) = _new_figure()
    for i, result in enumerate(results):
        if not result.slo.is_set():
            continue
        for j, run in enumerate(result.runs):
            ax.plot(scales, [run.summary(result.slo.scaled(s)).attainment for s in scales],
                    label=run_label(result, run), **_style(i, j))
    return _attainment_axes(fig, ax, f"SLO attainment vs SLO scale (1x = {_slo_text(results)})", "SLO scale factor")


def _attainment_axes(fig: Figure, ax, title: str, xlabel: str) -> Figure | None:
    """Finishes an attainment chart (the 90% line, labels, legend); None when nothing was drawn."""
    if not ax.lines:
        return None
    _target_line(ax)
    ax.set(title=title, xlabel=xlabel, ylabel="SLO attainment", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def _target_line(ax) -> None:
    # A leading underscore keeps the reference line out of the legend (and out of data lines).
    ax.axhline(ATTAINMENT_TARGET, color="grey", linestyle="--", linewidth=0.8, label="_target")


def _slo_text(results: list[BenchResult]) -> str:
    slos = {(r.slo.ttft_s, r.slo.tpot_s) for r in results if r.slo.is_set()}
    if len(slos) != 1:
        return "each result's own SLO"
    ttft, tpot = slos.pop()
    parts = ([f"TTFT {1000 * ttft:g} ms"] if ttft is not None else []) + (
        [f"TPOT {1000 * tpot:g} ms"] if tpot is not None else [])
    return ", ".join(parts)


def stage_bars_figure(results: list[BenchResult]) -> Figure | None:
    """One stacked bar per (result, rate): the mean of each stage the server reported (queued +
    prefill = the TTFT; transfer + decode_wait = a remote placement's KV hand-off after it, over
    the requests that had one). None when no server reported stages (not pdserve)."""
    bars = [(run_label(result, run), run.summary(result.slo).stages) for result in results for run in result.runs]
    bars = [(label, stages) for label, stages in bars if stages]
    if not bars:
        return None
    fig, (ax,) = _new_figure(1, 1, (max(6.0, 1.2 * len(bars) + 2), 4.5))
    bottoms = [0.0] * len(bars)
    for i, (stage, _, _) in enumerate(STAGES):
        heights = [1000 * stages[stage]["mean"] if stage in stages else 0.0 for _, stages in bars]
        if any(heights):
            ax.bar(range(len(bars)), heights, bottom=bottoms, label=stage, color=f"C{i}")
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], rotation=30, ha="right")
    ax.set_ylabel("mean ms")
    ax.set_title("Request stages: TTFT (queued + prefill), then the KV hand-off")
    ax.legend()
    return fig


def data_lines(fig: Figure) -> dict[str, list[str]]:
    """Each panel's title -> the labels of its data lines (what a reader sees in the legend)."""
    return {ax.get_title(): [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]
            for ax in fig.axes}


def plot_results(results: list[BenchResult], out_dir: Path, prefix: str = "") -> list[Path]:
    """Writes every chart the results can support (PREFIXlatency_cdf.png, ...); returns the files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    charts = {f"{prefix}latency_cdf.png": latency_cdf_figure(results),
              f"{prefix}attainment_vs_rate.png": attainment_vs_rate_figure(results),
              f"{prefix}attainment_vs_slo_scale.png": attainment_vs_slo_scale_figure(results),
              f"{prefix}stages.png": stage_bars_figure(results)}
    written = []
    for name, fig in charts.items():
        if fig is not None:
            fig.savefig(out_dir / name, dpi=110)
            written.append(out_dir / name)
    return written
