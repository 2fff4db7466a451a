"""A short real `pdserve bench` run against an in-process cluster: every request succeeds, the
counts and lengths are exact, and the JSON and CSV results are written."""

from __future__ import annotations

import csv
import json

from cluster.bench import bench, make_requests
from cluster.bench_metrics import SLO
from cluster.local_cluster import LocalCluster
from configs import EngineConfig


def test_workloads_are_seeded_and_shaped():
    a = make_requests("mixed", 20, 16, 4, 4096, seed=3)
    assert a == make_requests("mixed", 20, 16, 4, 4096, seed=3)
    assert {len(p) for p, _ in a} <= {16, 128} and all(n == 4 for _, n in a)
    shared = make_requests("prefix", 8, 32, 4, 4096, seed=1)
    assert len({tuple(p[:32]) for p, _ in shared}) <= 4


def test_short_bench_run_writes_results(tiny_dir, tmp_path):
    cluster = LocalCluster(tiny_dir, "disaggregated", EngineConfig(model="builtin:tiny", page_size=8))
    try:
        summary = bench(f"127.0.0.1:{cluster.port}", "fixed", 6, 24, 5, rate=50.0, seed=0, vocab=4096,
                        out_dir=tmp_path, slo=SLO(ttft_s=30.0, tpot_s=30.0), say=lambda line: None)
    finally:
        cluster.close()
    assert summary.num_requests == 6 and summary.num_failed == 0
    assert summary.attainment == 1.0 and summary.output_token_throughput > 0
    data = json.loads((tmp_path / "bench-fixed.json").read_text())
    assert [r["output_tokens"] for r in data["requests"]] == [5] * 6
    assert all(r["ttft_s"] > 0 and r["tpot_s"] > 0 for r in data["requests"])
    rows = list(csv.DictReader((tmp_path / "bench-fixed.csv").open()))
    assert len(rows) == 6 and {r["prompt_tokens"] for r in rows} == {"24"}
