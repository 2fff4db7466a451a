"""The cluster configs of the checked-in bench report load, give both systems the same cores,
and keep the colocated baseline free of chunked prefill (the case the report is about)."""

from __future__ import annotations

from pathlib import Path

from configs import load_cluster_config
from engine.builtin_models import BUILTIN_SPECS

BENCH_CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "bench"


def cores(cfg, pools: list[str]) -> float:
    return sum(getattr(cfg, p).num_cpus_per_worker * getattr(cfg, p).num_workers for p in pools)


def router_ports(cfg) -> set[int]:
    return {cfg.router.grpc_port, cfg.router.http_port, cfg.router.worker_event_port}


def test_report_configs_compare_like_with_like():
    colocated = load_cluster_config(BENCH_CONFIGS / "colocated-small.yaml")
    disagg = load_cluster_config(BENCH_CONFIGS / "disagg-small.yaml")
    assert colocated.mode == "colocated" and disagg.mode == "disaggregated"
    assert colocated.model == disagg.model == "builtin:small"
    assert cores(colocated, ["colocated"]) == cores(disagg, ["prefill", "decode"]) == 2
    # A budget of the model's whole context: any prompt is prefilled in one step, never chunked.
    assert colocated.colocated.engine.max_num_batched_tokens >= BUILTIN_SPECS["small"].max_position_embeddings
    assert not router_ports(colocated) & router_ports(disagg)
