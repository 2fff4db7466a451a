"""End to end through gRPC, in one process: a router (asyncio thread) and real prefill,
decode and colocated workers (threads) talking over ZMQ on loopback, KV moved over ZMQ.
Outputs must equal Hugging Face greedy; bad input, cancels, deadlines and bursts must be
answered with the right status and leave every page free."""

from __future__ import annotations

import asyncio
import re
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from configs import EngineConfig
from proto import pdserve_pb2 as pb
from tests.helpers import hf_greedy
from tests.local_cluster import LocalCluster

pytestmark = pytest.mark.cluster

ENGINE = EngineConfig(model="builtin:tiny", page_size=8, max_num_batched_tokens=64, max_num_seqs=16)


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def cluster(request, tiny_dir):
    c = LocalCluster(tiny_dir, request.param, ENGINE)
    yield c
    c.close()


def request(prompt, max_tokens=12, **sampling) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    if isinstance(prompt, str):
        return pb.GenerateRequest(text=prompt, sampling=params)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=params)


def streamed(stub, req) -> tuple[list[int], str, pb.GenerateResponse]:
    ids, text, last = [], "", None
    for resp in stub.Generate(req, timeout=60):
        ids += resp.token_ids
        text += resp.text
        last = resp
    return ids, text, last


def test_concurrent_mix_matches_hf(cluster, hf_tiny):
    """Requests in flight together each get their own tokens, under their own client ids (none
    given: a fresh one). "mix.retry1" looks like the router's name for a retry of "mix" on the
    workers; it cannot collide with it, because workers only see the router's own ids."""
    base = [0] + list(range(400, 460))
    prompts = [base, base[:40] + [1000, 1001], [0, 77], list(range(5, 35)), base[:24]]
    client_ids = ["mix", "mix.retry1", "", "", "mix-2"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = []
        for i, (p, client_id) in enumerate(zip(prompts, client_ids)):
            req = request(p)
            req.request_id = client_id
            if i % 2:
                futures.append(pool.submit(lambda req=req: cluster.stub.GenerateUnary(req, timeout=60)))
            else:
                futures.append(pool.submit(streamed_with_ids, cluster.stub, req))
        results = [f.result() for f in futures]
    tok = cluster.router.tokenizer
    echoed = []
    for i, (p, r) in enumerate(zip(prompts, results)):
        expected = hf_greedy(hf_tiny, p, 12)[0]
        (ids, text, last), seen = ((list(r.token_ids), r.text, r), {r.request_id}) if i % 2 else r
        assert ids == expected, f"prompt {i}"
        assert text == tok.decode(expected)
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert last.usage.prompt_tokens == len(p) and last.usage.completion_tokens == 12
        assert len(seen) == 1, f"prompt {i}: one id on every response, got {seen}"
        echoed += seen
    assert [e for e, given in zip(echoed, client_ids) if given] == [c for c in client_ids if c]
    assert all(echoed) and len(set(echoed)) == len(echoed)  # the router's ids for the others: fresh
    cluster.wait_pages_free()


def streamed_with_ids(stub, req) -> tuple[tuple[list[int], str, pb.GenerateResponse], set[str]]:
    responses = list(stub.Generate(req, timeout=60))
    ids = [t for r in responses for t in r.token_ids]
    return (ids, "".join(r.text for r in responses), responses[-1]), {r.request_id for r in responses}


def test_text_prompt_and_stop_string(cluster, hf_tiny):
    ids, text, last = streamed(cluster.stub, request("def main():", max_tokens=20))
    assert ids == hf_greedy(hf_tiny, cluster.router.tokenizer.encode("def main():"), 20)[0]
    stop = text[5:8]
    _, cut, stopped = streamed(cluster.stub, request("def main():", max_tokens=20, stop=[stop]))
    assert cut == text[: text.index(stop)] and stopped.finish_reason == pb.FINISH_REASON_STOP
    cluster.wait_pages_free()


@pytest.mark.parametrize(
    ("req", "message"),
    [
        (pb.GenerateRequest(), "prompt is missing"),
        (pb.GenerateRequest(text=""), "prompt text is empty"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "prompt token_ids is empty"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[0, 999999])), "token ids outside"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[0] * 2048)), "the model's context is 2048"),
        (request("x", max_tokens=0), "max_tokens must be >= 1"),
        (request("x", temperature=float("nan")), "temperature must be a finite number"),
        (request("x", temperature=float("inf")), "temperature must be a finite number"),
        (request("x", top_p=float("nan")), r"top_p must be in \(0, 1\]"),
        (request("x", stop_token_ids=[2**32 - 1]), "stop_token_ids outside the vocabulary"),
        (pb.GenerateRequest(text="x", timeout_s=float("nan")), r"timeout_s must be in \[0, 3600\]"),
        (request("x", top_p=1.5), r"top_p must be in \(0, 1\]"),
        (request("x", stop=[""]), "stop strings must be non-empty"),
        (pb.GenerateRequest(text="x", timeout_s=-1), r"timeout_s must be in \[0, 3600\]"),
        (pb.GenerateRequest(text="x", timeout_s=1e9), r"router.max_timeout_s"),
        (request("x", stop=["s"] * 17), r"17 stop strings: over router.max_stop_strings \(16\)"),
        (request("x", stop=["s" * 257]), r"router.max_stop_string_chars \(256\)"),
        (request("x", stop_token_ids=[1] * 65), r"65 stop token ids: over router.max_stop_token_ids \(64\)"),
        (pb.GenerateRequest(text="x" * (1 << 20 | 1)), r"router.max_prompt_bytes \(1048576 bytes\)"),
        (pb.GenerateRequest(text="é" * (1 << 19 | 1)), r"router.max_prompt_bytes"),  # counted in UTF-8 bytes
        (pb.GenerateRequest(request_id="a\nb", text="x"), "request_id must be 1-128 printable ASCII"),
        (pb.GenerateRequest(request_id="r" * 129, text="x"), "request_id must be 1-128 printable ASCII"),
    ],
)
def test_malformed_input_is_invalid_argument(cluster, hf_tiny, req, message):
    with pytest.raises(grpc.RpcError) as info:
        cluster.stub.GenerateUnary(req, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, info.value.details()), info.value.details()
    # ... and the server goes on serving, correctly
    assert list(cluster.stub.GenerateUnary(request([0, 5], max_tokens=2), timeout=30).token_ids) == \
        hf_greedy(hf_tiny, [0, 5], 2)[0]


def test_a_message_over_the_grpc_size_limit_is_resource_exhausted(cluster, hf_tiny):
    """gRPC itself refuses a request over 4 MiB (router/server.py MAX_REQUEST_BYTES) before it is parsed."""
    with pytest.raises(grpc.RpcError) as info:
        cluster.stub.GenerateUnary(pb.GenerateRequest(text="x" * (5 << 20)), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in info.value.details() and "4194304" in info.value.details()
    assert list(cluster.stub.GenerateUnary(request([0, 5], max_tokens=2), timeout=30).token_ids) == \
        hf_greedy(hf_tiny, [0, 5], 2)[0]


@pytest.mark.parametrize("seed", [2**64 - 1, 2**63, 0])
def test_every_seed_the_api_takes_is_served(cluster, seed):
    """The API's seed is a uint64; one at or above 2**63 once failed the workers' wire check, so
    each worker dropped the command and the request hung until its deadline. The same seed gives
    the same sampled tokens twice."""
    req = request([0, 5, 6], max_tokens=4, temperature=1.0, seed=seed)
    first = cluster.stub.GenerateUnary(req, timeout=15)
    assert len(first.token_ids) == 4
    assert cluster.stub.GenerateUnary(req, timeout=15).token_ids == first.token_ids
    cluster.wait_pages_free()


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(stop=["ab"])).SerializeToString().replace(
            b"ab", b"\xff\xfe"), "not a valid GenerateRequest.*UTF-8"),
        (pb.GenerateRequest(text="x").SerializeToString() + b"\xa0\x06\x01", r"unknown fields \[100\] in request"),
    ],
)
def test_undecodable_and_unknown_fields_are_invalid_argument(cluster, raw, message):
    call = cluster.channel.unary_unary("/pdserve.v1.Generation/GenerateUnary",
                                       request_serializer=lambda b: b, response_deserializer=pb.GenerateResponse.FromString)
    with pytest.raises(grpc.RpcError) as info:
        call(raw, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, info.value.details()), info.value.details()


def test_cancel_mid_stream_frees_pages(cluster):
    steps_before = cluster.hosts[-1].engine.num_steps
    call = cluster.stub.Generate(request([0] + list(range(600, 700)), max_tokens=1500), timeout=60)
    next(iter(call))  # first text has arrived: the request holds pages everywhere
    call.cancel()
    cluster.wait_pages_free()
    # Freed by the abort, not by running to its 1,500 tokens.
    assert cluster.hosts[-1].engine.num_steps - steps_before < 1000


def test_cancel_of_a_unary_call_mid_generation_frees_pages(cluster):
    """Not streaming: the client cancels while the router is still collecting tokens."""
    steps_before = cluster.hosts[-1].engine.num_steps
    call = cluster.stub.GenerateUnary.future(request([0] + list(range(600, 700)), max_tokens=1500), timeout=60)
    deadline = time.monotonic() + 10
    while cluster.router.in_flight.requests == 0 or cluster.hosts[-1].engine.num_steps == steps_before:
        assert time.monotonic() < deadline  # admitted and generating
        time.sleep(0.01)
    call.cancel()
    with pytest.raises(grpc.FutureCancelledError):
        call.result()
    deadline = time.monotonic() + 5
    while cluster.router.in_flight.requests:
        assert time.monotonic() < deadline, "the request outlived its client"
        time.sleep(0.01)
    cluster.wait_pages_free()
    assert cluster.hosts[-1].engine.num_steps - steps_before < 1000  # aborted, not run to its end


def test_deadline_expiry_aborts_and_frees_pages(cluster):
    steps_before = cluster.hosts[-1].engine.num_steps
    req = request([0] + list(range(700, 800)), max_tokens=1500)
    req.timeout_s = 0.3
    with pytest.raises(grpc.RpcError) as info:
        streamed(cluster.stub, req)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    cluster.wait_pages_free()
    assert cluster.hosts[-1].engine.num_steps - steps_before < 1000


def test_burst_beyond_the_queue_bound_is_resource_exhausted(tiny_dir):
    c = LocalCluster(tiny_dir, "disaggregated", ENGINE, max_queued_requests=2)
    try:
        def one(i):
            try:
                streamed(c.stub, request([0] + list(range(10 + i, 60 + i)), max_tokens=60))
                return "ok"
            except grpc.RpcError as exc:
                return exc.code()
        with ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(one, range(8)))
        assert outcomes.count("ok") >= 2
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in outcomes
        assert set(outcomes) <= {"ok", grpc.StatusCode.RESOURCE_EXHAUSTED}
        c.wait_pages_free()
    finally:
        c.close()


def test_prompt_tokens_in_flight_are_bounded_too(tiny_dir):
    """A 51-token prompt passes a 100-token bound alone; a second one in flight with it does not."""
    c = LocalCluster(tiny_dir, "disaggregated", ENGINE, max_queued_prompt_tokens=100)
    try:
        first = c.stub.Generate(request([0] + list(range(10, 60)), max_tokens=200), timeout=60)
        assert next(first).token_ids
        with pytest.raises(grpc.RpcError) as info:
            c.stub.GenerateUnary(request([0] + list(range(20, 70)), max_tokens=2), timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "router.max_queued_prompt_tokens (100)" in info.value.details()
        assert c.stub.GenerateUnary(request([0, 5], max_tokens=2), timeout=30).usage.completion_tokens == 2  # fits
        assert sum(len(r.token_ids) for r in first) == 199
        c.wait_pages_free()
    finally:
        c.close()


def test_reflection_lists_the_services(cluster):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(cluster.channel)
    [reply] = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    names = {s.name for s in reply.list_services_response.service}
    assert {"pdserve.v1.Generation", "grpc.health.v1.Health"} <= names


def test_no_live_worker_is_unavailable(tiny_dir):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    c = LocalCluster(tiny_dir, "colocated", ENGINE)
    try:
        # Every heartbeat now counts as stale, however fresh: no live worker. (0.01 s was a race:
        # a heartbeat read within 10 ms before the request made the worker live; seen once in CI.)
        c.router.pool.heartbeat_timeout_s = 0.0
        time.sleep(0.3)
        with pytest.raises(grpc.RpcError) as info:
            c.stub.GenerateUnary(request([0, 5], max_tokens=2), timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no healthy colocated worker" in info.value.details()
        status = health_pb2_grpc.HealthStub(c.channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        c.close()


def test_a_worker_that_dies_mid_stream_with_none_to_take_over_fails_the_request_fast(tiny_dir):
    """The only decode worker dies: the retry finds no healthy one within retry_wait_s, and the
    client hears why (tests/integration/test_fault_tolerance.py covers retries that succeed)."""
    c = LocalCluster(tiny_dir, "disaggregated", ENGINE, heartbeat_timeout_s=1.0, retry_wait_s=1.0)
    try:
        call = c.stub.Generate(request([0] + list(range(900, 950)), max_tokens=1900), timeout=120)
        next(iter(call))
        start = time.monotonic()
        c.hosts[1].stop()  # the decode worker dies: no more tokens, no more heartbeats
        with pytest.raises(grpc.RpcError) as info:
            for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no healthy decode worker (retrying after: worker decode-0 stopped responding" in info.value.details()
        assert time.monotonic() - start < 10  # not the request's 120 s deadline
        c.hosts[0].stop()
        assert c.hosts[0].page_stats()["referenced"] == 0  # the prefill side freed the lost attempt's KV
    finally:
        c.close()


def test_a_burst_queued_for_prefill_outlives_no_lease(tiny_dir, hf_tiny):
    """32 prompts of 1,000 tokens at once behind one prefill worker (64-token chunks) take
    longer to prefill than a decode reservation's 0.5 s lease. Without the router's prefill gate the
    leases of the queued ones run out (the control); with it they wait in the router holding
    nothing, and all succeed with HF greedy's tokens (the `pdserve up` twin: tests/integration/test_up_burst.py)."""
    prompts = [[0] + [(i * 37 + j) % 900 + 3 for j in range(1000)] for i in range(32)]

    def burst(c):
        def one(p):
            try:
                return streamed(c.stub, request(p, max_tokens=4))[0]
            except grpc.RpcError as exc:
                return exc.details()
        with ThreadPoolExecutor(32) as pool:
            return list(pool.map(one, prompts))

    for budget, all_ok in ((10**9, False), (1024, True)):
        # always: every prompt through the prefill worker (adaptive would compute the queued ones
        # on the decode worker instead, which is not what this checks)
        c = LocalCluster(tiny_dir, "disaggregated", ENGINE, lease_s=0.5, max_prefill_queue_tokens=budget,
                         disaggregation="always", max_attempts=1 if not all_ok else 3)
        try:
            outcomes = burst(c)
            if all_ok:
                assert outcomes == [hf_greedy(hf_tiny, p, 4)[0] for p in prompts]
            else:  # the control: the same burst with no gate loses requests to expired leases
                assert any("expired" in o for o in outcomes if isinstance(o, str))
            c.wait_pages_free()
        finally:
            c.close()


def test_a_reservation_naming_another_kv_address_is_refused_by_the_router(tiny_dir, hf_tiny):
    """The router knows decode-0 by a KV endpoint other than the one it bound (a worker that came
    up elsewhere than the cluster started it, or one lying): its Reserved names where KV would go,
    the router refuses to send the prompt's KV there, fails that request saying why, counts it,
    and the reservation is freed. Told the right address again, it serves HF greedy."""
    from dataclasses import replace

    c = LocalCluster(tiny_dir, "disaggregated", ENGINE)
    try:
        decode = c.router.pool.endpoints["decode-0"]

        def tell_router(endpoint):
            async def add():
                c.router.add_worker(endpoint)
            asyncio.run_coroutine_threadsafe(add(), c.loop).result(10)
            deadline = time.monotonic() + 10
            while not c.router.pool.healthy("decode-0"):  # the new entry waits for a heartbeat
                assert time.monotonic() < deadline
                time.sleep(0.05)

        tell_router(replace(decode, kv_address="127.0.0.1:1"))
        prefill_steps = c.hosts[0].engine.num_steps
        with pytest.raises(grpc.RpcError) as info:
            c.stub.GenerateUnary(request([0, 5, 6], max_tokens=4), timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert (f"decode worker decode-0 reserved pages at KV address {decode.kv_address!r}, not at its known "
                "KV endpoint '127.0.0.1:1': the prompt was not sent to prefill") in info.value.details()
        assert c.hosts[0].engine.num_steps == prefill_steps  # nothing was prefilled, nothing sent
        assert c.router.pool.rejected == {"kv_address": 1}
        assert ('pdserve_rejected_messages_total{reason="kv_address",socket="worker_events"} 1.0'
                in c.router.metrics.exposition().decode())
        c.wait_pages_free()  # the decode reservation was aborted
        tell_router(decode)
        assert list(c.stub.GenerateUnary(request([0, 5, 6], max_tokens=4), timeout=30).token_ids) == \
            hf_greedy(hf_tiny, [0, 5, 6], 4)[0]
        c.wait_pages_free()
    finally:
        c.close()


def test_a_request_id_already_in_flight_is_already_exists(cluster, hf_tiny):
    """A second live request under a client's id is refused; the first goes on untouched (its
    tokens are those it gets alone), and the id is free again once it ended. Inside the cluster
    the request goes by the router's own id, never the client's."""
    prompt = [0, 5, 6]
    slow = request(prompt, max_tokens=200)
    slow.request_id = "same-id"
    first = cluster.stub.Generate(slow, timeout=60)
    head = next(first)
    assert head.token_ids and head.request_id == "same-id"  # streaming: the first is in flight
    internal = cluster.router.live_ids.internal_id("same-id")
    assert internal and "same-id" not in internal
    with pytest.raises(grpc.RpcError) as info:
        cluster.stub.GenerateUnary(pb.GenerateRequest(request_id="same-id", text="x"), timeout=30)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS and "same-id" in info.value.details()
    rest = list(first)
    got = list(head.token_ids) + [t for r in rest for t in r.token_ids]
    assert {r.request_id for r in rest} == {"same-id"} and rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert cluster.router.live_ids.internal_id("same-id") is None
    assert got[:12] == hf_greedy(hf_tiny, prompt, 12)[0]
    again = cluster.stub.GenerateUnary(slow, timeout=60)  # ended ids are free again
    assert again.request_id == "same-id" and list(again.token_ids) == got  # the same tokens it gets alone
    cluster.wait_pages_free()


def test_logprobs_come_back_and_match_hf(cluster, hf_tiny):
    """Asked for, each token's log-probability travels with it (streamed and unary): the first
    from the prefill worker, the rest from decode; equal to HF's log-softmax within float noise."""
    prompt = [0] + list(range(600, 630))
    want_ids, want_lps = hf_greedy(hf_tiny, prompt, 10)
    req = request(prompt, max_tokens=10, logprobs=True)
    streamed_lps = [lp for r in cluster.stub.Generate(req, timeout=60) for lp in r.logprobs]
    unary = cluster.stub.GenerateUnary(req, timeout=60)
    assert list(unary.token_ids) == want_ids
    for got in (streamed_lps, list(unary.logprobs)):
        assert len(got) == 10 and max(abs(a - b) for a, b in zip(got, want_lps)) < 2e-3
    assert not cluster.stub.GenerateUnary(request(prompt, max_tokens=3), timeout=60).logprobs  # not asked
    cluster.wait_pages_free()
