"""A bounded load test (issue 11): waves of 300 concurrent requests over both front doors (gRPC
and OpenAI HTTP) of an in-process cluster, colocated and 1P1D, seeded, with clients that cancel
or disconnect at random moments (streaming and not, before and after their first token).

It proves that under load nothing admitted fails, completed outputs still equal Hugging Face
greedy, and every client that went away is counted CANCELLED and not generated to its end; and
that afterwards nothing is left behind: no KV page referenced and no request running or waiting
on any worker, no request in the router's books (in flight, prompt tokens, per worker, the
prefill gate), and the process's RSS grew by less than a stated bound over the second wave."""

from __future__ import annotations

import asyncio
import gc
import json
import random
import time
from dataclasses import dataclass

import aiohttp
import grpc
import pytest

from configs import EngineConfig
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc
from router.openai_http import OpenAIServer
from tests.helpers import hf_greedy
from tests.local_cluster import LocalCluster

pytestmark = pytest.mark.cluster

MODEL = "builtin:tiny"
ENGINE = EngineConfig(model=MODEL, page_size=8)
NUM_REQUESTS = 300  # per wave, all in flight together
# Non-streaming HTTP requests whose clients disconnect: sent ahead of the rest of the wave and
# admitted before it starts, so each disconnect is known to come after admission (such a client
# sees nothing before its answer, so it cannot tell otherwise).
NUM_UNARY_DISCONNECTS = 20
# Every other request's kind, by share. A `*_cancel`/`*_disconnect` client goes away after its
# first 1-3 responses; `grpc_cancel_early` cancels within 30 ms of sending, before or after the
# router admitted it (the only kind whose CANCELLED count is not known exactly).
KINDS = {"grpc_stream": 5, "grpc_unary": 2, "grpc_cancel": 4, "grpc_cancel_early": 2,
         "http_stream": 4, "http_unary": 2, "http_disconnect": 4}
# A request whose client goes away asks for the rest of the model's 2,048-token context: at the
# tiny model's speed here it would run for seconds, far longer than its client stays, so
# counting it finished would mean the cancel did not abort it.
CONTEXT = 2048
# Growth of the test process's RSS over the second wave. Everything (router, workers, clients)
# is in this process, so this is the router's RSS plus the rest; the first wave pays the one-off
# costs (threads, gRPC and aiohttp buffers, the engines' workspaces for larger batches). Measured
# on a 2-core EPYC over the second wave: colocated 80-90 MiB, 1P1D 8-15 MiB; colocated, still
# 45-70 MiB a wave over 8 waves (chunked prefill mixes more batch shapes), while Python's own
# objects stay flat (tracemalloc: under 1 MiB a wave, the prefix cache's maps). The growth is
# native, through either door alike (gRPC-only and HTTP-only waves grow the same), and about
# halves with oneDNN's primitive cache off: not yet explained. So the bound is 160 MiB a wave,
# ~0.5 MiB a request: a request that kept a tensor per step (its logits alone are 16 KiB a
# token) passes it at once; that slow growth, and a leak of a few KiB a request, do not. (KV
# pages are preallocated: a leaked page shows in wait_pages_free, not in RSS.)
RSS_GROWTH_BOUND_MIB = 160
REQUEST_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Plan:
    kind: str
    prompt: list[int]
    max_tokens: int
    reads: int = 0  # responses (streamed chunks) read before going away
    delay_s: float = 0.0  # when to go away, for the kinds that do not wait for output


@dataclass
class Outcome:
    plan: Plan
    completed: bool  # the whole answer arrived (else the client went away)
    token_ids: list[int] | None = None  # gRPC
    text: str = ""
    completion_tokens: int = 0
    finish: str = ""


def make_plans(rng: random.Random) -> tuple[list[Plan], list[Plan]]:
    """(non-streaming HTTP disconnects, everything else), seeded."""
    def prompt() -> list[int]:
        return [0] + [rng.randrange(3, 4096) for _ in range(rng.randrange(3, 48))]

    def plan(kind: str) -> Plan:
        p = prompt()
        goes_away = kind.endswith(("cancel", "disconnect", "cancel_early"))
        return Plan(kind, p, CONTEXT - len(p) if goes_away else rng.randrange(2, 12), reads=rng.randrange(1, 4),
                    delay_s=rng.uniform(0.0, 0.03) if kind == "grpc_cancel_early" else rng.uniform(0.05, 1.0))

    unary_disconnects = [plan("http_unary_disconnect") for _ in range(NUM_UNARY_DISCONNECTS)]
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=NUM_REQUESTS - NUM_UNARY_DISCONNECTS)
    return unary_disconnects, [plan(k) for k in kinds]


def grpc_request(plan: Plan) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=plan.prompt),
                              sampling=pb.SamplingParams(max_tokens=plan.max_tokens, ignore_eos=True))


async def run_grpc(stub, plan: Plan) -> Outcome:
    if plan.kind == "grpc_unary":
        r = await stub.GenerateUnary(grpc_request(plan), timeout=REQUEST_TIMEOUT_S)
        return Outcome(plan, True, list(r.token_ids), r.text, r.usage.completion_tokens,
                       pb.FinishReason.Name(r.finish_reason))
    call = stub.Generate(grpc_request(plan), timeout=REQUEST_TIMEOUT_S)
    if plan.kind == "grpc_cancel_early":
        await asyncio.sleep(plan.delay_s)
        call.cancel()
        return Outcome(plan, False)
    ids, text, last, reads = [], "", None, 0
    while (r := await call.read()) is not grpc.aio.EOF:
        ids += r.token_ids
        text += r.text
        last, reads = r, reads + 1
        if plan.kind == "grpc_cancel" and reads >= plan.reads:
            call.cancel()
            return Outcome(plan, False)
    return Outcome(plan, True, ids, text, last.usage.completion_tokens, pb.FinishReason.Name(last.finish_reason))


async def run_http(session: aiohttp.ClientSession, url: str, plan: Plan) -> Outcome:
    stream = plan.kind in ("http_stream", "http_disconnect")
    body = {"model": MODEL, "prompt": plan.prompt, "max_tokens": plan.max_tokens, "ignore_eos": True,
            "stream": stream}
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        if not stream:
            out = await resp.json()
            choice = out["choices"][0]
            return Outcome(plan, True, None, choice["text"], out["usage"]["completion_tokens"], choice["finish_reason"])
        text, chunks, usage, finish = "", 0, None, ""
        async for line in resp.content:
            data = line.decode().strip().removeprefix("data:").strip()
            if not data or data == "[DONE]":
                continue
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"]
            finish = chunk["choices"][0]["finish_reason"] or finish
            usage = chunk.get("usage") or usage
            chunks += 1
            if plan.kind == "http_disconnect" and chunks >= plan.reads:
                resp.close()  # drops the connection mid-stream, as a client that goes away does
                return Outcome(plan, False)
        return Outcome(plan, True, None, text, usage["completion_tokens"], finish)


async def run_wave(cluster: LocalCluster, http_port: int, seed: int) -> list[Outcome]:
    """One wave: every request in flight together; returns each one's outcome."""
    unary_disconnects, rest = make_plans(random.Random(seed))
    url = f"http://127.0.0.1:{http_port}/v1/completions"
    # limit=0: no client-side pool cap, or the requests would queue here instead of in the router.
    async with (grpc.aio.insecure_channel(f"127.0.0.1:{cluster.port}") as channel,
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                      timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as session):
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        early = [asyncio.create_task(run_http(session, url, p)) for p in unary_disconnects]
        deadline = time.monotonic() + 30
        while early and cluster.router.in_flight.requests < len(early):  # all admitted (nothing else is in flight yet)
            assert time.monotonic() < deadline, f"only {cluster.router.in_flight.requests} admitted"
            await asyncio.sleep(0.01)
        tasks = [asyncio.create_task(run_grpc(stub, p) if p.kind.startswith("grpc") else run_http(session, url, p))
                 for p in rest]
        loop = asyncio.get_running_loop()
        for task, plan in zip(early, unary_disconnects):
            loop.call_later(plan.delay_s, task.cancel)  # closes the connection: the client is gone
        outcomes = await asyncio.gather(*tasks)
        for task, plan in zip(early, unary_disconnects):
            try:
                outcomes.append(await task)  # answered before its client left: a completed request
            except asyncio.CancelledError:
                outcomes.append(Outcome(plan, False))
    return outcomes


def rss_mib() -> float:
    gc.collect()
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def counter(cluster: LocalCluster, name: str, **labels: str) -> float:
    return cluster.router.metrics.registry.get_sample_value(name, labels) or 0.0


def assert_nothing_left(cluster: LocalCluster) -> None:
    """No page referenced and no request running or waiting on any worker; the router's books
    empty. Polled briefly: aborts reach the workers asynchronously."""
    cluster.wait_pages_free(timeout_s=15.0)
    router = cluster.router
    deadline = time.monotonic() + 10
    while True:
        workers = {h.worker_id: (h.state()["running"], h.state()["waiting"], router.pool.in_flight(h.worker_id))
                   for h in cluster.hosts}
        books = {"in_flight": router.in_flight.requests, "prompt_tokens": router.in_flight.prompt_tokens,
                 "gauge": counter(cluster, "pdserve_requests_in_flight"),
                 "gate": (router.prefill_gate.num_waiting,
                          sum(router.prefill_gate.outstanding(h.worker_id) for h in cluster.hosts))}
        if all(v == (0, 0, 0) for v in workers.values()) and books == {
                "in_flight": 0, "prompt_tokens": 0, "gauge": 0.0, "gate": (0, 0)}:
            return
        assert time.monotonic() < deadline, f"left behind: workers (running, waiting, router's count) {workers}, " \
                                            f"router {books}"
        time.sleep(0.05)


@pytest.fixture(params=["colocated", "disaggregated"])
def served(request, tiny_dir):
    # Admission bounds above a wave: this test is about what cancels leave behind, not about
    # RESOURCE_EXHAUSTED (tests/integration/test_grpc_serving.py covers that).
    cluster = LocalCluster(tiny_dir, request.param, ENGINE, max_queued_requests=4 * NUM_REQUESTS)
    server = OpenAIServer(cluster.router, tiny_dir, MODEL)
    try:
        port = asyncio.run_coroutine_threadsafe(server.start("127.0.0.1", 0), cluster.loop).result(10)
        yield cluster, port
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), cluster.loop).result(10)
        cluster.close()


def test_hundreds_of_streams_with_cancels_and_disconnects_leave_nothing_behind(served, hf_tiny):
    cluster, http_port = served
    tok = cluster.router.tokenizer
    rss = [rss_mib()]
    for seed in (1, 2):
        cancelled_before = counter(cluster, "pdserve_request_errors_total", status="CANCELLED")
        finished_before = counter(cluster, "pdserve_requests_finished_total", finish_reason="length")
        errors_before = {s: counter(cluster, "pdserve_request_errors_total", status=s)
                         for s in ("RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "INTERNAL")}
        start = time.monotonic()
        outcomes = asyncio.run(run_wave(cluster, http_port, seed))
        wave_s = time.monotonic() - start
        assert len(outcomes) == NUM_REQUESTS
        assert_nothing_left(cluster)
        rss.append(rss_mib())

        completed = [o for o in outcomes if o.completed]
        gone = [o for o in outcomes if not o.completed]
        early = [o for o in gone if o.plan.kind == "grpc_cancel_early"]
        # Every completed request got exactly what it asked for (ignore_eos: its full length).
        for o in completed:
            assert (o.completion_tokens, o.finish) in ((o.plan.max_tokens, "length"),
                                                       (o.plan.max_tokens, "FINISH_REASON_LENGTH")), o
        # A sample of them equals HF greedy token for token (gRPC ids; HTTP text, as decoded).
        sample = random.Random(seed).sample(completed, min(16, len(completed)))
        for o in sample:
            want = hf_greedy(hf_tiny, o.plan.prompt, o.plan.max_tokens)[0]
            if o.token_ids is not None:
                assert o.token_ids == want, o.plan
            assert o.text == tok.decode(want), o.plan
        # Each client that left after admission is one CANCELLED; an early cancel may have beaten
        # admission (then nothing was admitted to cancel). Nothing else failed.
        cancelled = counter(cluster, "pdserve_request_errors_total", status="CANCELLED") - cancelled_before
        assert len(gone) - len(early) <= cancelled <= len(gone), (cancelled, len(gone), len(early))
        for status, before in errors_before.items():
            assert counter(cluster, "pdserve_request_errors_total", status=status) == before, status
        # Finished with all their tokens: exactly the completed ones. A cancelled request run to
        # its ~2,000 tokens would count here too.
        finished = counter(cluster, "pdserve_requests_finished_total", finish_reason="length") - finished_before
        assert finished == len(completed), (finished, len(completed))
        print(f"wave {seed}: {len(completed)} completed, {len(gone)} went away ({cancelled:.0f} CANCELLED) "
              f"in {wave_s:.1f} s; RSS {rss[-2]:.0f} -> {rss[-1]:.0f} MiB")
    assert rss[2] - rss[1] < RSS_GROWTH_BOUND_MIB, f"RSS (MiB) at start, after wave 1, after wave 2: {rss}"
