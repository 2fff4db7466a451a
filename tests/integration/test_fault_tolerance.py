"""Surviving worker failures, in one process: a router and two prefill plus two decode workers
(threads, real ZMQ and gRPC). A fault hook crashes a worker at one stage of a chosen request's
journey, as a killed process would (no more events, no more heartbeats), while other requests
run beside it. Every request must end within its deadline with exactly Hugging Face's greedy
tokens (a lost attempt is resumed from the prompt plus the tokens already streamed), and the
surviving workers must hold no pages afterwards."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from cluster.worker_host import WorkerHost
from configs import EngineConfig
from proto import pdserve_pb2 as pb
from proto import worker_messages as wm
from tests.helpers import hf_greedy
from tests.local_cluster import LocalCluster

pytestmark = pytest.mark.cluster

# A 64-token prefill budget: the longer prompts prefill in several chunks, so pages are already
# on their way when the first token is produced.
ENGINE = EngineConfig(model="builtin:tiny", page_size=8, max_num_batched_tokens=64, max_num_seqs=16)
PROMPTS = [list(range(10, 110)), [0, 77, 5], list(range(200, 240)), list(range(300, 390)), [0] + list(range(500, 520)),
           list(range(600, 612))]
TARGET = "req-3"  # the request whose journey the fault is pinned to
MAX_TOKENS = 12
ROUTER = {"heartbeat_timeout_s": 1.0, "retry_wait_s": 5.0}


class Target:
    """Which worker-side ids are TARGET's. Workers never see a client's id, only the router's
    internal one (router/request_ids.py), so the hooks ask the router (`router` is set once the
    cluster is up, before any request) for the internal id of the live request TARGET."""

    def __init__(self) -> None:
        self.router = None

    def owns(self, request_id: str) -> bool:
        internal = self.router.live_ids.internal_id(TARGET) if self.router is not None else None
        return internal is not None and request_id.split(".retry")[0] == internal  # or a retry of it


def crash_once(role: str, event: type, when: str, nth: int, target: Target):
    """Hooks for every worker of `role`: the first one to emit its `nth` `event` for TARGET
    (or a retry of it) crashes there, once for the whole cluster."""
    lock = threading.Lock()
    seen = {"count": 0, "fired": False}

    def hook(message: object) -> str | None:
        if not isinstance(message, event) or not target.owns(message.request_id):
            return None
        with lock:
            seen["count"] += 1
            if seen["fired"] or seen["count"] < nth:
                return None
            seen["fired"] = True
        return when

    return {f"{role}-{i}": hook for i in range(2)}


STAGES = {
    # Reserved never reaches the router: the decode worker died holding the reservation.
    "reserved": ("decode", wm.Reserved, "before", 1),
    # Prefill computed (earlier chunks' pages already shipped) but the first token is lost.
    "prefill running": ("prefill", wm.FirstToken, "before", 1),
    # The client has the first token; the prefill dies before shipping the rest of the KV.
    "transfer in flight": ("prefill", wm.FirstToken, "after", 1),
    # The KV arrived; the prefill worker dies afterwards (the request needs nothing from it).
    "transfer done": ("prefill", wm.TransferEnded, "after", 1),
    # The client has a few tokens; the decode worker dies mid-stream.
    "decoding": ("decode", wm.Tokens, "before", 3),
}


@pytest.fixture(scope="module")
def expected(hf_tiny):
    return [hf_greedy(hf_tiny, p, MAX_TOKENS)[0] for p in PROMPTS]


def run_all(cluster: LocalCluster) -> list[list[int] | grpc.RpcError]:
    def one(i: int):
        req = pb.GenerateRequest(request_id=f"req-{i}", token_ids=pb.TokenIds(ids=PROMPTS[i]),
                                 sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        ids = []
        try:
            for resp in cluster.stub.Generate(req, timeout=60):
                ids += resp.token_ids
        except grpc.RpcError as exc:
            return exc
        return ids

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, range(len(PROMPTS))))


@pytest.mark.slow
@pytest.mark.parametrize("stage", list(STAGES))
def test_a_worker_dies_at_each_stage(tiny_dir, expected, stage):
    role, event, when, nth = STAGES[stage]
    target = Target()
    cluster = LocalCluster(tiny_dir, "disaggregated", ENGINE, num_workers=2,
                           crash_when=crash_once(role, event, when, nth, target), **ROUTER)
    target.router = cluster.router
    try:
        start = time.monotonic()
        results = run_all(cluster)
        assert time.monotonic() - start < 60
        crashed = [h.worker_id for h in cluster.hosts if h.crashed]
        assert len(crashed) == 1 and crashed[0].startswith(role), crashed
        for i, got in enumerate(results):
            assert not isinstance(got, grpc.RpcError), f"req-{i}: {got.code()} {got.details()}"
            assert got == expected[i], f"req-{i}"
        cluster.wait_pages_free()
    finally:
        cluster.close()


def test_a_worker_replaced_faster_than_the_heartbeat_timeout_is_noticed(tiny_dir, expected):
    """The decode worker dies mid-stream and a new process takes its id and ports at once, so
    heartbeats never pause: the new incarnation in its heartbeats tells the router that the
    request's state is gone, and the request is resumed (on the replacement) long before the
    heartbeat timeout or the deadline."""
    target = Target()
    hooks = {"decode-0": crash_once("decode", wm.Tokens, "before", 2, target)["decode-0"]}
    cluster = LocalCluster(tiny_dir, "disaggregated", ENGINE, crash_when=hooks, heartbeat_timeout_s=30.0)
    target.router = cluster.router
    old = next(h for h in cluster.hosts if h.worker_id == "decode-0")
    try:
        req = pb.GenerateRequest(request_id=TARGET, token_ids=pb.TokenIds(ids=PROMPTS[3]),
                                 sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        call = cluster.stub.Generate(req, timeout=60)
        start = time.monotonic()
        got = list(next(iter(call)).token_ids)
        while not old.crashed:
            time.sleep(0.01)
        fresh = WorkerHost(old.spec)  # same id and ports, a new incarnation
        fresh.start()
        cluster.hosts.append(fresh)  # closed (and its pages checked) with the cluster
        got += [t for r in call for t in r.token_ids]
        assert got == expected[3]
        assert time.monotonic() - start < 15  # not the 30 s heartbeat timeout, not the 60 s deadline
        cluster.wait_pages_free()
    finally:
        cluster.close()


def test_a_stream_that_already_ended_is_finished_not_retried(tiny_dir, expected):
    """max_tokens=1: the client has its only token when the decode worker dies before reporting
    the finish; the router finishes the stream itself (length) instead of asking for 0 tokens."""
    target = Target()
    hooks = {"decode-0": crash_once("decode", wm.Tokens, "before", 1, target)["decode-0"]}
    cluster = LocalCluster(tiny_dir, "disaggregated", ENGINE, crash_when=hooks, heartbeat_timeout_s=1.0,
                           retry_wait_s=0.5)
    target.router = cluster.router
    try:
        req = pb.GenerateRequest(request_id=TARGET, token_ids=pb.TokenIds(ids=PROMPTS[0]),
                                 sampling=pb.SamplingParams(max_tokens=1, ignore_eos=True))
        last = list(cluster.stub.Generate(req, timeout=60))[-1]
        assert list(last.token_ids) in ([], expected[0][:1])
        assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.usage.completion_tokens == 1
        assert any(h.crashed for h in cluster.hosts)
    finally:
        cluster.close()
