"""Short real `pdserve bench` runs against an in-process cluster serving builtin:tiny: the CLI
over the OpenAI HTTP backend writes JSON, CSV and PNGs with exact output lengths, and the gRPC
backend sees the same requests with the same token counts."""

from __future__ import annotations

import asyncio
import csv
import json

import pytest

from cluster.cli import main
from configs import EngineConfig
from loadgen.metrics import SLO
from loadgen.results import load_result
from loadgen.runner import BenchPlan, run_bench
from loadgen.workloads import LengthDist, WorkloadSpec
from router.openai_http import OpenAIServer
from tests.local_cluster import LocalCluster

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def served(tiny_dir):
    cluster = LocalCluster(tiny_dir, "disaggregated", EngineConfig(model="builtin:tiny", page_size=8))
    server = OpenAIServer(cluster.router, tiny_dir, "builtin:tiny")
    http_port = asyncio.run_coroutine_threadsafe(server.start("127.0.0.1", 0), cluster.loop).result(10)
    yield cluster, http_port
    asyncio.run_coroutine_threadsafe(server.stop(), cluster.loop).result(10)
    cluster.close()


def test_cli_bench_over_openai_http_writes_json_csv_and_pngs(served, tmp_path, capsys):
    cluster, http_port = served
    code = main(["bench", "--backend", "openai", "--address", f"http://127.0.0.1:{http_port}", "--workload", "mixed",
                 "--num-prompts", "6", "--input-len", "12", "--long-factor", "4", "--long-fraction", "0.5",
                 "--output-len", "6", "--output-dist", "uniform", "--output-range-ratio", "0.5",
                 "--rates", "40,80", "--slo-ttft", "30", "--slo-tpot", "30", "--label", "tiny-http",
                 "--out", str(tmp_path), "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "mixed @ 40 req/s: 6 requests (0 failed)" in printed and "short:" in printed and "long:" in printed
    data = json.loads((tmp_path / "tiny-http.json").read_text())
    assert data["label"] == "tiny-http" and data["backend"] == "openai" and len(data["runs"]) == 2
    expected = WorkloadSpec("mixed", 6, LengthDist(12), LengthDist(6, "uniform", 0.5), long_fraction=0.5, long_factor=4)
    for run in data["runs"]:
        reqs = run["requests"]
        assert all(r["ok"] for r in reqs) and {r["kind"] for r in reqs} <= {"short", "long"}
        assert {r["prompt_tokens"] for r in reqs} <= {12, 48}
        # Exact output lengths (ignore_eos), counted from the usage in the final SSE chunk.
        assert all(3 <= r["output_tokens"] <= 9 for r in reqs)
        assert all(0 < r["ttft_s"] <= r["e2e_s"] and r["tpot_s"] > 0 for r in reqs)
        assert run["summary"]["attainment"] == 1.0
    assert data["workload"]["output_len"] == {"mean": 6, "kind": "uniform", "range_ratio": 0.5}
    rows = list(csv.DictReader((tmp_path / "tiny-http.csv").open()))
    assert len(rows) == 12 and {r["rate"] for r in rows} == {"40.0", "80.0"}
    for name in ("latency_cdf", "attainment_vs_rate", "attainment_vs_slo_scale"):
        assert (tmp_path / f"tiny-http-{name}.png").read_bytes()[:4] == b"\x89PNG"
    # The gRPC backend on the same plan: the same requests, so the same token counts.
    plan = BenchPlan(expected, rates=(40.0, 80.0), slo=SLO(30.0, 30.0), warmup_requests=0)
    grpc_result = run_bench("grpc", f"127.0.0.1:{cluster.port}", plan, "tiny-grpc", progress=False, say=lambda _: None)
    http_result = load_result(tmp_path / "tiny-http.json")
    for g, h in zip(grpc_result.runs, http_result.runs):
        assert [(r.prompt_tokens, r.num_tokens, r.kind) for r in g.records] == [
            (r.prompt_tokens, r.num_tokens, r.kind) for r in h.records]
        assert all(len(r.token_times) == r.num_tokens for r in g.records)  # one token per gRPC message here
    cluster.wait_pages_free()
    # Overlaying both on one chart: one line per label.
    (tmp_path / "grpc").mkdir()
    from loadgen.results import write_result

    write_result(grpc_result, tmp_path / "grpc")
    assert main(["bench", "plot", str(tmp_path / "tiny-http.json"), str(tmp_path / "grpc" / "tiny-grpc.json"),
                 "--out", str(tmp_path / "overlay")]) == 0
    assert sorted(p.name for p in (tmp_path / "overlay").iterdir()) == [
        "attainment_vs_rate.png", "attainment_vs_slo_scale.png", "latency_cdf.png", "stages.png"]


def test_throughput_burst_and_unreachable_targets(served, tmp_path):
    cluster, _ = served
    spec = WorkloadSpec("throughput", 5, LengthDist(10), LengthDist(4), seed=5)
    result = run_bench("grpc", f"127.0.0.1:{cluster.port}", BenchPlan(spec, max_concurrency=2, warmup_requests=0),
                       "burst", progress=False, say=lambda _: None)
    (run,) = result.runs
    assert [r.num_tokens for r in run.records] == [4] * 5 and all(r.ok for r in run.records)
    # A server that is not there: every request fails with a named error, nothing raises.
    from tests.local_cluster import free_port

    down = run_bench("grpc", f"127.0.0.1:{free_port()}", BenchPlan(spec, warmup_requests=0), "down",
                     progress=False, say=lambda _: None)
    assert all(not r.ok and r.error == "UNAVAILABLE" for r in down.runs[0].records)
    assert down.runs[0].summary().num_failed == 5
    with pytest.raises(RuntimeError, match="no model list"):
        run_bench("openai", f"http://127.0.0.1:{free_port()}", BenchPlan(spec), "down", progress=False)


def test_openai_backend_records_http_errors(served):
    _, http_port = served
    # Token ids beyond the tiny model's 4096-token vocabulary: the server answers 400 per request.
    spec = WorkloadSpec("fixed", 3, LengthDist(8), LengthDist(4), vocab_size=100_000)
    result = run_bench("openai", f"127.0.0.1:{http_port}", BenchPlan(spec, warmup_requests=0), "bad",
                       progress=False, say=lambda _: None)
    assert [(r.ok, r.error, r.num_tokens) for r in result.runs[0].records] == [(False, "HTTP 400", 0)] * 3
