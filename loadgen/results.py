"""A bench result and its files: what one `pdserve bench` run measured, as JSON and CSV.

Last step of a bench run (loadgen/runner.py writes it) and the input of `bench plot` and
`bench compare` (loadgen/plots.py, cluster/bench_compare.py read it back). The JSON keeps
every request's token arrival times, so every metric can be recomputed from the file with
loadgen/metrics.py; the summaries stored beside them are for people reading the file.
Strict JSON: a burst's rate is written as null and undefined numbers (NaN) as null.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from loadgen.metrics import (
    SLO,
    RequestRecord,
    Summary,
    max_rate_at_attainment,
    summarize_run,
)

ATTAINMENT_TARGET = 0.9


@dataclass(frozen=True)
class BenchRun:
    """All requests sent at one arrival rate (inf = a burst)."""

    rate: float
    duration_s: float
    records: tuple[RequestRecord, ...]

    def summary(self, slo: SLO | None = None) -> Summary:
        return summarize_run(self.records, self.duration_s, slo)

    def kinds(self) -> list[str]:
        return sorted({r.kind for r in self.records})

    def summary_of_kind(self, kind: str, slo: SLO | None = None) -> Summary:
        """Latency percentiles of one request class (e.g. mixed's "short"); throughputs are that
        class's share over the whole run's duration."""
        return summarize_run([r for r in self.records if r.kind == kind], self.duration_s, slo)


@dataclass(frozen=True)
class BenchResult:
    label: str  # the system or configuration measured: one line per label on every plot
    backend: str
    target: str
    workload: dict  # the WorkloadSpec, as asdict() wrote it
    slo: SLO
    burstiness: float
    max_concurrency: int | None
    runs: tuple[BenchRun, ...]

    def max_rate_at_attainment(self, target: float = ATTAINMENT_TARGET) -> float:
        """Interpolated from the runs at finite rates; NaN without an SLO or a sweep."""
        swept = [run for run in self.runs if math.isfinite(run.rate)]
        if not self.slo.is_set() or len(swept) < 2:
            return math.nan
        return max_rate_at_attainment([r.rate for r in swept], [r.summary(self.slo).attainment for r in swept], target)


def _clean(value):
    """NaN/inf -> None, recursively: json.dumps would otherwise write non-standard NaN/Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _request_json(r: RequestRecord, start: float) -> dict:
    return {"kind": r.kind, "ok": r.ok, "error": r.error, "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.num_tokens, "arrival_s": r.arrival - start,
            "ttft_s": r.ttft, "tpot_s": r.tpot, "e2e_s": r.e2e,
            "token_times_s": [t - r.arrival for t in r.token_times], "stages_s": r.stages}


def to_json(result: BenchResult) -> dict:
    runs = []
    for run in result.runs:
        start = min((r.arrival for r in run.records), default=0.0)
        kinds = run.kinds()
        runs.append({
            "rate": run.rate, "duration_s": run.duration_s, "summary": asdict(run.summary(result.slo)),
            "by_kind": {k: asdict(run.summary_of_kind(k, result.slo)) for k in kinds} if len(kinds) > 1 else {},
            "requests": [_request_json(r, start) for r in run.records],
        })
    return _clean({
        "label": result.label, "backend": result.backend, "target": result.target, "workload": result.workload,
        "slo": asdict(result.slo), "burstiness": result.burstiness, "max_concurrency": result.max_concurrency,
        f"max_rate_at_{round(100 * ATTAINMENT_TARGET)}pct_attainment": result.max_rate_at_attainment(),
        "runs": runs,
    })


def from_json(data: dict) -> BenchResult:
    runs = []
    for run in data["runs"]:
        records = tuple(
            RequestRecord(r["arrival_s"], tuple(r["arrival_s"] + t for t in r["token_times_s"]), r["output_tokens"],
                          r["prompt_tokens"], ok=r["ok"], error=r["error"], kind=r["kind"],
                          stages=r.get("stages_s") or {})  # results written before stages had none
            for r in run["requests"])
        runs.append(BenchRun(math.inf if run["rate"] is None else run["rate"], run["duration_s"], records))
    return BenchResult(data["label"], data["backend"], data["target"], data["workload"], SLO(**data["slo"]),
                       data["burstiness"], data["max_concurrency"], tuple(runs))


def load_result(path: str | Path) -> BenchResult:
    try:
        return from_json(json.loads(Path(path).read_text()))
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a pdserve bench result ({exc})") from None


CSV_COLUMNS = ["label", "rate", "kind", "ok", "error", "prompt_tokens", "output_tokens", "arrival_s",
               "ttft_s", "tpot_s", "e2e_s"]


def write_result(result: BenchResult, out_dir: Path, name: str | None = None) -> tuple[Path, Path]:
    """Writes NAME.json (everything) and NAME.csv (one row per request); NAME defaults to the label."""
    out_dir.mkdir(parents=True, exist_ok=True)
    name = name or result.label
    data = to_json(result)
    json_path, csv_path = out_dir / f"{name}.json", out_dir / f"{name}.csv"
    json_path.write_text(json.dumps(data, indent=1, allow_nan=False))
    with csv_path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for run in data["runs"]:
            for r in run["requests"]:
                w.writerow([result.label, run["rate"] if run["rate"] is not None else "inf",
                            *(r[c] for c in CSV_COLUMNS[2:])])
    return json_path, csv_path
