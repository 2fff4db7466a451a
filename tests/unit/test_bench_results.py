"""Bench results without a server: the load loop's timing and concurrency cap against a fake
backend, the JSON/CSV round trip, the overlay plots, and the compare ratio table."""

from __future__ import annotations

import asyncio
import csv
import json
import math
import time
from dataclasses import replace

import pytest

from loadgen.client import BaseBackend
from loadgen.compare import comparison_rows, format_table
from loadgen.metrics import SLO, RequestRecord, percentile
from loadgen.plots import (
    attainment_vs_rate_figure,
    attainment_vs_slo_scale_figure,
    data_lines,
    latency_cdf_figure,
    plot_results,
    stage_bars_figure,
)
from loadgen.results import BenchResult, BenchRun, load_result, write_result
from loadgen.runner import run_load
from loadgen.workloads import BenchRequest


class FakeBackend(BaseBackend):
    """Answers after `service_s` with `output_len` tokens 10 ms apart, tracking concurrency."""

    def __init__(self, service_s: float = 0.05) -> None:
        self.service_s, self.in_flight, self.max_in_flight, self.sent_at = service_s, 0, 0, []

    async def send(self, request: BenchRequest, arrival: float) -> RequestRecord:
        self.sent_at.append(arrival)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.service_s)
        self.in_flight -= 1
        now = time.perf_counter()
        return RequestRecord(arrival, tuple(now + 0.01 * i for i in range(request.output_len)), request.output_len,
                             len(request.prompt), kind=request.kind)


def requests(n: int) -> list[BenchRequest]:
    return [BenchRequest((0, 5, 6), 3, "fixed") for _ in range(n)]


def test_burst_honours_max_concurrency_and_records_every_request():
    backend = FakeBackend(0.05)
    records, duration = asyncio.run(run_load(backend, requests(8), [0.0] * 8, max_concurrency=2))
    assert backend.max_in_flight == 2 and len(records) == 8 and all(r.num_tokens == 3 for r in records)
    assert duration >= 4 * 0.05  # 8 requests, 2 at a time
    # Arrival is when a request is sent: a capped request's wait for a slot is not its TTFT.
    assert max(r.ttft for r in records) < 0.05 + 0.04


def test_requests_go_out_at_their_offsets():
    backend = FakeBackend(0.0)
    offsets = [0.0, 0.1, 0.25]
    asyncio.run(run_load(backend, requests(3), offsets))
    sent = [t - backend.sent_at[0] for t in backend.sent_at]
    assert sent == pytest.approx(offsets, abs=0.03)


def record(ttft: float, tpot: float, n: int = 5, kind: str = "fixed", arrival: float = 0.0) -> RequestRecord:
    return RequestRecord(arrival, tuple(arrival + ttft + tpot * i for i in range(n)), n, 16, kind=kind)


TARGETS = SLO(ttft_s=0.5, tpot_s=0.05)


def result(label: str, scale: float = 1.0, rates=(1.0, 2.0, 4.0), slo=TARGETS) -> BenchResult:
    """Attainment falls with rate (requests get slower); `scale` slows every latency."""
    runs = []
    for rate in rates:
        slow = 0.0 if math.isinf(rate) else rate / 4
        recs = [record(scale * (0.1 + slow * i / 10), scale * 0.02 * (1 + slow * i / 5),
                       kind="long" if i % 5 == 0 else "short", arrival=0.1 * i) for i in range(10)]
        runs.append(BenchRun(rate, 10.0, tuple(recs)))
    return BenchResult(label, "grpc", "127.0.0.1:1", {"name": "mixed"}, slo, 1.0, None, tuple(runs))


def test_json_round_trip_keeps_every_metric_and_csv_has_a_row_per_request(tmp_path):
    original = result("colocated")
    json_path, csv_path = write_result(original, tmp_path)
    data = json.loads(json_path.read_text())  # strict JSON (no NaN/Infinity)
    assert data["label"] == "colocated" and [r["rate"] for r in data["runs"]] == [1.0, 2.0, 4.0]
    assert set(data["runs"][0]["by_kind"]) == {"long", "short"}
    assert data["max_rate_at_90pct_attainment"] == pytest.approx(original.max_rate_at_attainment())
    loaded = load_result(json_path)
    for a, b in zip(original.runs, loaded.runs):
        assert a.summary(original.slo).tpot == pytest.approx(b.summary(loaded.slo).tpot)
        assert a.summary(original.slo).attainment == b.summary(loaded.slo).attainment
        assert [r.kind for r in a.records] == [r.kind for r in b.records]
    rows = list(csv.DictReader(csv_path.open()))
    assert len(rows) == 30 and {r["rate"] for r in rows} == {"1.0", "2.0", "4.0"}
    burst = load_result(write_result(result("b", rates=(math.inf,), slo=SLO()), tmp_path)[0])
    assert math.isinf(burst.runs[0].rate) and not burst.slo.is_set()


def test_max_rate_is_interpolated_from_the_sweep():
    r = result("x")
    attainments = [run.summary(r.slo).attainment for run in r.runs]
    assert attainments[0] == 1.0 and attainments[-1] < 0.9  # the synthetic sweep crosses the target
    assert 1.0 <= r.max_rate_at_attainment() < 4.0


def test_plots_have_one_line_per_run_and_are_pngs(tmp_path):
    a, b = result("colocated"), result("disaggregated", scale=0.7)
    cdf = data_lines(latency_cdf_figure([a, b]))
    assert set(cdf) == {"TTFT CDF", "TPOT CDF", "ITL CDF", "E2E CDF"}
    assert all(len(labels) == 6 for labels in cdf.values())  # 2 results x 3 rates
    assert "colocated @ 2 req/s" in cdf["TTFT CDF"]
    assert list(data_lines(attainment_vs_rate_figure([a, b])).values()) == [["colocated", "disaggregated"]]
    single = [result("one", rates=(2.0,)), result("two", rates=(2.0,))]
    scale_fig = attainment_vs_slo_scale_figure(single)
    assert list(data_lines(scale_fig).values()) == [["one", "two"]]
    line = scale_fig.axes[0].get_lines()[0]
    assert list(line.get_ydata()) == sorted(line.get_ydata())  # a looser SLO never lowers attainment
    assert attainment_vs_rate_figure(single) is None  # nothing swept
    paths = plot_results([a, b], tmp_path)
    assert sorted(p.name for p in paths) == ["attainment_vs_rate.png", "attainment_vs_slo_scale.png", "latency_cdf.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000 for p in paths)
    assert [p.name for p in plot_results([result("n", slo=SLO())], tmp_path / "noslo")] == ["latency_cdf.png"]


def test_server_reported_stages_survive_json_and_stack_into_one_bar_per_run(tmp_path):
    """pdserve's Usage stages (RequestRecord.stages): summarized per run, written and read back,
    drawn as one stacked bar per (result, rate); a server that reports none gets no chart."""
    plain = result("peer", rates=(1.0,))
    assert stage_bars_figure([plain]) is None and plain.runs[0].summary().stages == {}
    staged = []
    for i, r in enumerate(plain.runs[0].records):
        handoff = {"transfer": 0.01, "decode_wait": 0.002} if i % 2 else {}  # every other one remote
        staged.append(replace(r, stages={"queued": 0.05 * i, "prefill": 0.1, **handoff}))
    ours = replace(plain, label="pdserve", runs=(replace(plain.runs[0], records=tuple(staged)),))
    stages = ours.runs[0].summary().stages
    assert stages["queued"]["mean"] == pytest.approx(0.225) and stages["prefill"]["p99"] == pytest.approx(0.1)
    assert stages["transfer"]["mean"] == pytest.approx(0.01)  # over the requests that had a hand-off
    loaded = load_result(write_result(ours, tmp_path)[0])
    assert [r.stages for r in loaded.runs[0].records] == [r.stages for r in staged]
    fig = stage_bars_figure([ours, plain])
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["queued", "prefill", "transfer", "decode_wait"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["pdserve"]  # the peer reported nothing
    top = max(p.get_y() + p.get_height() for p in ax.patches)
    assert top == pytest.approx(1000 * (0.225 + 0.1 + 0.01 + 0.002))
    assert "stages.png" in [p.name for p in plot_results([ours], tmp_path / "plots")]


def test_compare_table_ratios_against_the_first_config():
    base, other = result("colocated"), result("disaggregated", scale=0.5)
    rows = comparison_rows([base, other])
    assert [(r.label, r.rate) for r in rows] == [("colocated", 1.0), ("colocated", 2.0), ("colocated", 4.0),
                                                  ("disaggregated", 1.0), ("disaggregated", 2.0), ("disaggregated", 4.0)]
    assert all(v == pytest.approx(1.0) for r in rows[:3] for k, v in r.ratios.items() if not math.isnan(v))
    d = rows[3]
    assert d.ratios["ttft_p50"] == pytest.approx(0.5) and d.ratios["tpot_p99"] == pytest.approx(0.5)
    assert d.ratios["output_token_throughput"] == pytest.approx(1.0)
    # Short requests' p99 TPOT comes from the short requests alone (the long ones are every 5th).
    shorts = [rec.tpot for rec in base.runs[0].records if rec.kind == "short"]
    assert rows[0].values["short_tpot_p99"] < max(rec.tpot for rec in base.runs[0].records)
    assert len(shorts) == 8 and rows[0].values["short_tpot_p99"] == pytest.approx(percentile(shorts, 99))
    table = format_table(rows)
    assert table.splitlines()[0].startswith("| config | rate | req/s | out tok/s | TTFT p50 |")
    assert "short TPOT p99" in table and "(0.50x)" in table and "against colocated" in table
    with pytest.raises(ValueError, match="other rates"):
        comparison_rows([base, result("x", rates=(1.0,))])


def test_compare_table_leaves_out_metrics_nobody_has():
    rows = comparison_rows([result("a", rates=(math.inf,), slo=SLO()), result("b", rates=(math.inf,), slo=SLO())])
    header = format_table(rows).splitlines()[0]
    assert "goodput" not in header and "attainment" not in header and "| burst |" in format_table(rows)
