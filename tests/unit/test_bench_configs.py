"""The cluster configs of the checked-in bench report load, give both systems the same cores,
and keep the colocated baseline free of chunked prefill (the case the report is about)."""

from __future__ import annotations

from pathlib import Path

from configs import load_cluster_config
from engine.model.builtin import BUILTIN_SPECS

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


def test_goodput_layouts_share_the_same_two_cores():
    """benchmarks/pd_goodput.py: 1P2D and 2P1D fit the cores colocated and 1P1D get, and no
    two layouts' router ports collide (each runs alone, but a leftover must not block the next)."""
    layouts = {name: load_cluster_config(BENCH_CONFIGS / f"{name}.yaml")
               for name in ("colocated-small", "disagg-small", "disagg-1p2d-small", "disagg-2p1d-small")}
    assert (layouts["disagg-1p2d-small"].prefill.num_workers, layouts["disagg-1p2d-small"].decode.num_workers) == (1, 2)
    assert (layouts["disagg-2p1d-small"].prefill.num_workers, layouts["disagg-2p1d-small"].decode.num_workers) == (2, 1)
    for name in ("disagg-1p2d-small", "disagg-2p1d-small"):
        assert 1.9 < cores(layouts[name], ["prefill", "decode"]) <= 2
    ports = [cfg.router.grpc_port for cfg in layouts.values()]
    assert len(set(ports)) == len(ports)


def test_the_tuned_speculative_config_is_the_plain_one_plus_the_draft_settings():
    """configs/bench/spec-1p1d-code-tuned.yaml (benchmarks/spec_served.py) differs from
    spec-1p1d-code.yaml only in the decode pool's draft settings and the router's ports."""
    plain = load_cluster_config(BENCH_CONFIGS / "spec-1p1d-code.yaml")
    tuned = load_cluster_config(BENCH_CONFIGS / "spec-1p1d-code-tuned.yaml")
    spec = tuned.decode.engine.speculative
    assert (spec.draft_vocab_size, spec.fallback_ngram_min, spec.draft_quantization) == (2048, 2, "int8")
    assert spec.model_copy(update={"draft_vocab_size": None, "fallback_ngram_min": 1, "draft_quantization": "none"}) \
        == plain.decode.engine.speculative
    assert tuned.prefill == plain.prefill and tuned.model == plain.model
    assert not (router_ports(plain) & router_ports(tuned)) - {None}  # (no HTTP port in either)


def test_the_concurrency_1_config_is_the_tuned_one_with_a_fixed_k():
    """configs/bench/spec-1p1d-code-c1.yaml differs from spec-1p1d-code-tuned.yaml only in k
    (5, never adapted) and the router's ports, so the two compare the k rule alone."""
    tuned = load_cluster_config(BENCH_CONFIGS / "spec-1p1d-code-tuned.yaml")
    c1 = load_cluster_config(BENCH_CONFIGS / "spec-1p1d-code-c1.yaml")
    spec = c1.decode.engine.speculative
    assert (spec.num_tokens, spec.adaptive) == (5, False)
    assert spec.model_copy(update={"num_tokens": 4, "adaptive": True}) == tuned.decode.engine.speculative
    assert c1.prefill == tuned.prefill and c1.model == tuned.model
    assert c1.decode.model_copy(update={"engine": tuned.decode.engine}) == tuned.decode
    assert not (router_ports(c1) & router_ports(tuned)) - {None}
