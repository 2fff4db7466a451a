"""Per-request placement served end to end, in one process (router/placement/): the router and
real prefill and decode workers over ZMQ and gRPC. Every placement (remote, local, suffix)
gives Hugging Face's greedy tokens; prompts queued behind a busy prefill worker move to the
decode worker; and with every prefill worker killed under load, no request fails."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from configs import EngineConfig
from proto import pdserve_pb2 as pb
from proto import worker_messages as wm
from tests.helpers import hf_greedy
from tests.local_cluster import LocalCluster

pytestmark = pytest.mark.cluster

ENGINE = EngineConfig(model="builtin:tiny", page_size=8, max_num_batched_tokens=64, max_num_seqs=16)
BASE = [0] + list(range(400, 470))


def generate(cluster: LocalCluster, prompt: list[int], max_tokens: int = 10) -> pb.GenerateResponse:
    """The unary reply: every token id, and the usage (with where the prompt was computed)."""
    return cluster.stub.GenerateUnary(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
        timeout=60)


def placements(cluster: LocalCluster) -> dict[tuple[str, str], float]:
    counter = cluster.router.metrics.placements
    return {(s.labels["placement"], s.labels["reason"]): s.value for m in counter.collect() for s in m.samples
            if s.name.endswith("_total")}


@pytest.mark.parametrize(("mode", "expected"), [("always", ("remote", "always")), ("never", ("local", "never"))])
def test_remote_and_local_placements_match_hf(tiny_dir, hf_tiny, mode, expected):
    c = LocalCluster(tiny_dir, "disaggregated", ENGINE, disaggregation=mode)
    try:
        prompts = [BASE, [0, 77, 5], list(range(5, 35))]
        for p in prompts:
            reply = generate(c, p)
            assert list(reply.token_ids) == hf_greedy(hf_tiny, p, 10)[0]
            assert reply.usage.placement == expected[0]
        assert placements(c) == {expected: 3.0}
        decode = next(h for h in c.hosts if h.role == "decode")
        transfers = decode.engine.handoff  # a local placement reserves nothing on the decode side
        assert not transfers._reserved and not transfers._held
        c.wait_pages_free()
    finally:
        c.close()


def test_a_decode_worker_holding_the_prefix_computes_only_the_suffix(tiny_dir, hf_tiny):
    """The first request leaves its pages in decode-0's prefix cache; its KV block events reach
    the router's index; a second prompt sharing that prefix is computed there past it."""
    c = LocalCluster(tiny_dir, "disaggregated", ENGINE, disaggregation="never")
    try:
        first = generate(c, BASE)
        assert list(first.token_ids) == hf_greedy(hf_tiny, BASE, 10)[0]
        index = c.router.pool.blocks
        hashes = index.prompt_hashes(BASE)
        deadline = time.monotonic() + 10
        while index.cached_tokens(hashes, ["decode-0"])["decode-0"] < 64 and time.monotonic() < deadline:
            time.sleep(0.05)
        longer = BASE + [9, 8, 7, 6]
        second = generate(c, longer)
        assert list(second.token_ids) == hf_greedy(hf_tiny, longer, 10)[0]
        assert second.usage.placement == "suffix" and second.usage.cached_prompt_tokens >= 64
        assert placements(c)[("suffix", "never")] == 1.0
    finally:
        c.close()


def test_prompts_queued_behind_a_busy_prefill_worker_move_to_the_decode_worker(tiny_dir, hf_tiny):
    """32 prompts of 600 tokens at once, one prefill worker computing 64 tokens a step, the
    router's queue at most 1,024 tokens per prefill worker: once the prefill worker has measured
    its rate, the cost model computes the waiting ones on the idle decode worker instead."""
    prompts = [[0] + [(i * 37 + j) % 900 + 3 for j in range(600)] for i in range(32)]
    c = LocalCluster(tiny_dir, "disaggregated", ENGINE, max_prefill_queue_tokens=1024)
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            replies = list(pool.map(lambda p: generate(c, p, max_tokens=4), prompts))
        assert [list(r.token_ids) for r in replies] == [hf_greedy(hf_tiny, p, 4)[0] for p in prompts]
        kinds = {r.usage.placement for r in replies}
        assert kinds == {"remote", "local"}, kinds
        counted = placements(c)
        assert counted[("local", "prefill_queue")] >= 1 and sum(counted.values()) == 32
        c.wait_pages_free()
    finally:
        c.close()


def test_killing_every_prefill_worker_under_load_fails_no_request(tiny_dir, hf_tiny):
    """Both prefill workers die mid-load (each at its third first token, as a killed process
    stops); what they held is retried, and with no prefill worker left, the decode workers
    compute every prompt themselves: all 24 requests end with HF's greedy tokens."""
    prompts = [BASE[: 20 + i] + [i] for i in range(24)]
    crash = {f"prefill-{i}": (lambda n: lambda m: "before" if isinstance(m, wm.FirstToken) and next(n) == 2 else None)(
        iter(range(100))) for i in range(2)}
    c = LocalCluster(tiny_dir, "disaggregated", ENGINE, num_workers=2, crash_when=crash, heartbeat_timeout_s=1.0,
                     retry_wait_s=5.0, disaggregation="always")
    try:
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda p: generate(c, p, max_tokens=6), prompts))
        assert [list(r.token_ids) for r in replies] == [hf_greedy(hf_tiny, p, 6)[0] for p in prompts]
        assert all(h.crashed for h in c.hosts if h.role == "prefill")
        assert c.router.is_ready()  # the decode workers still serve
        counted = placements(c)
        # the prompts share BASE, so a decode worker holding it computes only the rest (suffix)
        fallback = counted.get(("local", "no_prefill_worker"), 0) + counted.get(("suffix", "no_prefill_worker"), 0)
        assert fallback >= 1 and sum(counted.values()) >= 24, counted
        late = generate(c, [0, 5, 6, 7])  # after: straight to a decode worker
        assert late.usage.placement == "local" and list(late.token_ids) == hf_greedy(hf_tiny, [0, 5, 6, 7], 10)[0]
        c.wait_pages_free()
        text = c.router.metrics.exposition().decode()
        assert 'reason="no_prefill_worker"}' in text
    finally:
        c.close()
