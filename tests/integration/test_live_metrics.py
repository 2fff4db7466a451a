"""Live metrics after real traffic through an in-process disaggregated cluster (router on an
asyncio thread, prefill and decode workers on threads, ZMQ between them): each worker's
/metrics is scraped over HTTP and checked against what the traffic must have done; the
router's goodput counter is checked with SLOs every request meets and with SLOs none can."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from configs import EngineConfig
from engine.metrics.peak import Peak
from proto import pdserve_pb2 as pb
from tests.local_cluster import LocalCluster

pytestmark = pytest.mark.cluster

PAGE = 8
ENGINE = EngineConfig(model="builtin:tiny", page_size=PAGE, max_num_batched_tokens=64, max_num_seqs=8)
# A peak far above what this CPU reaches, so MBU and MFU land in (0, 1].
PEAK = Peak.configured(memory_bandwidth_gbps=10_000, tflops=1_000)


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    """Every sample as {(name, sorted labels without worker_id/role): value}."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("worker_id", "role")))
            out[(s.name, labels)] = s.value
    return out


def worker_labels(address: str) -> set[tuple[str, str]]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {(s.labels["worker_id"], s.labels["role"]) for f in text_string_to_metric_families(text)
            for s in f.samples if "worker_id" in s.labels}


def generate(cluster, ids, max_tokens=6):
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                             sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return list(cluster.stub.Generate(req, timeout=60))[-1]


@pytest.fixture(scope="module")
def cluster(tiny_dir):
    c = LocalCluster(tiny_dir, "disaggregated", ENGINE, metrics_peak=PEAK, slo_ttft_ms=60_000, slo_tpot_ms=60_000)
    yield c
    c.close()


def test_worker_metrics_after_traffic(cluster):
    shared = [0] + list(range(300, 330))  # 31 tokens: 3 full pages shared
    prompts = [shared + [901, 902, 903], shared + [904, 905], list(range(50, 70))]
    for p in prompts:  # one at a time: the second hits the first's pages
        generate(cluster, p)
    cluster.wait_pages_free()
    prefill, decode = scrape(cluster.metrics_address("prefill-0")), scrape(cluster.metrics_address("decode-0"))
    assert worker_labels(cluster.metrics_address("prefill-0")) == {("prefill-0", "prefill")}
    assert worker_labels(cluster.metrics_address("decode-0")) == {("decode-0", "decode")}

    # Pages return to 0 used once every request is done, on both sides.
    for m in (prefill, decode):
        assert m[("pdserve_worker_kv_pages_used", ())] == 0
        assert m[("pdserve_worker_kv_pages_free", ())] == m[("pdserve_worker_kv_pages_total", ())] > 0
        assert m[("pdserve_worker_requests_running", ())] == m[("pdserve_worker_requests_waiting", ())] == 0

    # Prefill computed exactly the prompt tokens its prefix cache did not hold.
    prompt_tokens = sum(len(p) for p in prompts)
    hits = prefill[("pdserve_worker_prefix_cache_hit_tokens_total", ())]
    assert hits == 3 * PAGE  # the second prompt reuses the shared prefix's 3 full pages
    assert prefill[("pdserve_worker_prefix_cache_queried_tokens_total", ())] == prompt_tokens
    assert prefill[("pdserve_worker_prefill_tokens_total", ())] == prompt_tokens - hits
    assert 0 < prefill[("pdserve_worker_prefix_cache_hit_rate", ())] == pytest.approx(hits / prompt_tokens)
    assert prefill[("pdserve_worker_decode_tokens_total", ())] == 0
    # Decode computed every token after the first (which the prefill side sampled).
    assert decode[("pdserve_worker_decode_tokens_total", ())] == 3 * (6 - 1)
    assert decode[("pdserve_worker_prefill_tokens_total", ())] == 0

    # Transfer bytes = pages sent * page bytes, the same on both sides; one latency sample per transfer.
    kv = cluster.hosts[0].engine.kv_cache
    page_bytes = 2 * len(kv.k) * kv.k[0][0].numel() * kv.k[0].element_size()
    cached_on_decode = decode[("pdserve_worker_prefix_cache_hit_tokens_total", ())] // PAGE
    pages_sent = sum(-(-len(p) // PAGE) for p in prompts) - cached_on_decode
    sent = prefill[("pdserve_worker_kv_transfer_bytes_total", (("direction", "sent"),))]
    assert sent == pages_sent * page_bytes
    assert decode[("pdserve_worker_kv_transfer_bytes_total", (("direction", "received"),))] == sent
    assert prefill[("pdserve_worker_kv_transfer_seconds_count", (("side", "send"),))] == len(prompts)
    assert decode[("pdserve_worker_kv_transfer_seconds_count", (("side", "receive"),))] == len(prompts)
    assert not [k for k in {**prefill, **decode} if k[0] == "pdserve_worker_kv_transfer_failures_total"]

    # Step times, queue times, rates and utilisation.
    assert prefill[("pdserve_worker_prefill_step_seconds_count", ())] >= len(prompts)
    assert prefill[("pdserve_worker_queue_time_seconds_count", ())] == len(prompts)
    assert decode[("pdserve_worker_decode_step_seconds_count", ())] >= 6 - 1
    assert prefill[("pdserve_worker_prefill_tokens_per_second", ())] > 0
    assert decode[("pdserve_worker_decode_tokens_per_second", ())] > 0
    assert 0 < prefill[("pdserve_worker_prefill_mfu", ())] <= 1
    assert 0 < decode[("pdserve_worker_decode_mbu", ())] <= 1
    assert decode[("pdserve_worker_peak_memory_bytes_per_second", (("source", "configured"),))] == 1e13


def test_router_goodput_with_slos_met_and_missed(tiny_dir, cluster):
    prompt = list(range(10, 30))
    value = cluster.router.metrics.registry.get_sample_value
    met0, dispatched0 = value("pdserve_goodput_requests_total"), value("pdserve_router_queue_time_seconds_count")
    generate(cluster, prompt)
    assert value("pdserve_goodput_requests_total") == met0 + 1  # 60 s targets: met
    assert value("pdserve_slo_attainment_ratio") == 1.0
    assert value("pdserve_router_queue_time_seconds_count") == dispatched0 + 1
    assert value("pdserve_slo_ttft_target_seconds") == 60.0

    strict = LocalCluster(tiny_dir, "disaggregated", ENGINE, slo_ttft_ms=1e-6, slo_tpot_ms=1e-6)
    try:
        generate(strict, prompt)
        generate(strict, prompt)
        value = strict.router.metrics.registry.get_sample_value
        assert value("pdserve_goodput_requests_total") == 0  # nothing meets a 1 ns TTFT
        assert value("pdserve_slo_attainment_ratio") == 0.0
        assert value("pdserve_requests_finished_total", {"finish_reason": "length"}) == 2
    finally:
        strict.close()
