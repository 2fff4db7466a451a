"""Every internal socket of a live disaggregated cluster takes thousands of random and mutated
messages (random bytes, truncated msgpack, wrong types, NaN and huge numbers, unknown fields,
valid messages for ids nobody holds) and keeps serving: no loop dies, no page stays referenced,
and a normal request afterwards still equals Hugging Face greedy.

Sockets: the router's worker-event socket, each worker's command socket, the decode worker's
KV socket. Seeded; a few seconds. And a well-formed command that only a forger would send: a
Prefill naming a KV destination that is no decode worker of the cluster."""

from __future__ import annotations

import asyncio
import math
import random
import time

import msgpack
import pytest
import zmq

from configs import EngineConfig
from proto import pdserve_pb2 as pb
from proto import worker_messages as wm
from tests.helpers import hf_greedy
from tests.local_cluster import LocalCluster

pytestmark = pytest.mark.cluster

ENGINE = EngineConfig(model="builtin:tiny", page_size=8, max_num_batched_tokens=64, max_num_seqs=16)
NUM_PER_SOCKET = 1500
SAMPLING = {"max_tokens": 4, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": None, "stop_token_ids": [],
            "ignore_eos": True, "logprobs": False}
# Messages a peer could send that are harmless when well-formed (ids nobody holds); the fuzzer
# breaks them. Well-formed reservations and prompts are left out: a real one takes pages until
# its lease ends, which is the lease bound's job, not this test's.
TEMPLATES = [
    {"type": "Abort", "request_id": "r"},
    {"type": "Tokens", "request_id": "r", "worker_id": "decode-0", "token_ids": [1, 2], "logprobs": [],
     "finished": False, "finish_reason": None, "num_cached_prompt_tokens": 0},
    {"type": "FirstToken", "request_id": "r", "worker_id": "prefill-0", "token_id": 3, "logprob": None,
     "num_cached_prompt_tokens": 0},
    {"type": "Failed", "request_id": "r", "worker_id": "decode-0", "stage": "decode", "reason": "x"},
    {"type": "TransferEnded", "request_id": "r", "worker_id": "prefill-0", "state": "done"},
    {"type": "ReserveKV", "request_id": "r", "prompt_token_ids": [1, 2, 3], "lease_s": 1.0, "sampling": SAMPLING},
    {"type": "Prefill", "request_id": "r", "prompt_token_ids": [1, 2, 3], "sampling": SAMPLING,
     "kv": {"address": "127.0.0.1:1", "num_pages": 1, "skip_pages": 0, "timeout_s": 1.0}},
]
BAD_VALUES = [None, True, -1, 2**63, -(2**63), 1e308, math.nan, math.inf, "", "x" * 5000, [], [None], {}, {"a": 1},
              b"\xff", [2**40] * 3, "r"]


def mutated(rng: random.Random) -> bytes:
    kind = rng.random()
    if kind < 0.15:
        return rng.randbytes(rng.randrange(0, 64))
    message = dict(rng.choice(TEMPLATES))
    message["request_id"] = f"fuzz-{rng.randrange(1 << 30)}"  # nobody holds it
    if kind < 0.3:
        return msgpack.packb(message)[: rng.randrange(1, 20)]  # truncated
    if kind < 0.45:
        message[rng.choice(["extra", "type", "request_id"])] = rng.choice(BAD_VALUES)  # unknown field / bad id
    elif kind < 0.9:
        # a wrong value in a field that must be right (the valid-looking ones are dropped below)
        field = rng.choice([k for k in message if k != "type"])
        message[field] = rng.choice(BAD_VALUES)
    else:
        message.pop(rng.choice([k for k in message if k != "type"]))
    if message.get("type") in ("ReserveKV", "Prefill") and _well_formed(message):
        message["lease_s" if "lease_s" in message else "sampling"] = math.nan  # keep pages out of it
    return msgpack.packb(message, use_bin_type=True)


def _well_formed(message: dict) -> bool:
    try:
        wm.decode(msgpack.packb(message, use_bin_type=True))
    except ValueError:
        return False
    return True


def kv_frame(rng: random.Random) -> list[bytes]:
    """A page / done / abort frame with a broken header or a payload that disagrees with it."""
    header = {"kind": rng.choice(["pages", "done", "abort", "nope", 7]), "request_id": rng.choice(
        [f"fuzz-{rng.randrange(1 << 30)}", 5, None, ["x"], "y" * 300]), "first_page": rng.choice([0, -1, 2**40, "0"]),
        "num_pages": rng.choice([1, 0, 2**40, None]), "dtype": rng.choice(["float32", "int8", "nope", 3]),
        "shape": rng.choice([[2, 2, 1, 8, 2, 16], [1], "x", None]), "first_token": rng.choice([1, -1, "a", None])}
    if rng.random() < 0.3:
        head = rng.randbytes(rng.randrange(0, 32))
    else:
        head = msgpack.packb(rng.choice([header, [1, 2], 5, "s"]), use_bin_type=True, default=str)
    return [head, rng.randbytes(rng.randrange(0, 256))][: rng.choice([1, 2])]


@pytest.fixture(scope="module")
def cluster(tiny_dir):
    c = LocalCluster(tiny_dir, "disaggregated", ENGINE)
    yield c
    c.close()


def push(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 5000)  # a socket whose loop died stops taking messages: zmq.Again
    sock.connect(f"tcp://{address}")
    return sock


def test_every_internal_socket_survives_fuzzing(cluster, hf_tiny):
    rng = random.Random(1234)
    decode = next(h for h in cluster.hosts if h.role == "decode")
    targets = {"router events": cluster.router.event_address}
    targets |= {f"{h.worker_id} commands": h.command_address for h in cluster.hosts}
    sockets = {name: push(address) for name, address in targets.items()}
    kv = push(f"127.0.0.1:{decode.spec.kv_port}")
    try:
        for _ in range(NUM_PER_SOCKET):
            for sock in sockets.values():
                sock.send(mutated(rng))
            kv.send_multipart(kv_frame(rng))
        time.sleep(2.0)  # let every loop take it all in
    finally:
        for sock in [*sockets.values(), kv]:
            sock.close()
    assert all(h.alive() and not h.crashed for h in cluster.hosts), [h.state() for h in cluster.hosts]
    assert cluster.router.pool.all_healthy(["prefill", "decode"])
    assert sum(cluster.router.pool.rejected.values()) >= NUM_PER_SOCKET // 2  # dropped and counted
    prompt = [0] + list(range(300, 340))
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=12,
                                                                                           ignore_eos=True))
    out = cluster.stub.GenerateUnary(req, timeout=60)
    assert list(out.token_ids) == hf_greedy(hf_tiny, prompt, 12)[0]
    cluster.wait_pages_free()


def on_router_loop(cluster, fn, timeout_s: float = 15.0):
    """`fn()` (a value or an awaitable) on the router's event loop, where its tables live."""
    async def call():
        result = fn()
        return await result if asyncio.iscoroutine(result) else result

    return asyncio.run_coroutine_threadsafe(call(), cluster.loop).result(timeout_s)


def test_a_forged_prefill_pushes_no_kv_to_the_address_it_names(cluster, hf_tiny):
    """A well-formed Prefill on the prefill worker's command socket whose KV destination is a
    listener of this test's, not a decode worker: the worker refuses it and says why to the
    router, not one frame reaches the listener, and the next request is served as before with
    every page freed."""
    prefill = next(h for h in cluster.hosts if h.role == "prefill")
    listener = zmq.Context.instance().socket(zmq.PULL)
    listener.setsockopt(zmq.LINGER, 0)
    port = listener.bind_to_random_port("tcp://127.0.0.1")
    rid = "forged-destination"
    events = on_router_loop(cluster, lambda: cluster.router.pool.subscribe(rid))
    prompt = [0] + list(range(300, 340))
    rejected = prefill.state()["rejected"].get("unknown_kv_destination", 0)
    sock = push(prefill.command_address)
    try:
        forged = wm.Prefill(rid, tuple(prompt), wm.Sampling(max_tokens=4, ignore_eos=True),
                            wm.KVDestination(f"127.0.0.1:{port}", 6, 0, 5.0, "token"))
        sock.send(wm.encode(forged))
        failed = on_router_loop(cluster, lambda: asyncio.wait_for(events.get(), 10))
        assert isinstance(failed, wm.Failed) and failed.worker_id == prefill.worker_id and failed.stage == "prefill"
        assert f"KV destination '127.0.0.1:{port}' is not a known decode endpoint" in failed.reason
        assert prefill.state()["rejected"]["unknown_kv_destination"] == rejected + 1
        assert listener.poll(1000) == 0  # no connection made, no KV frame sent
    finally:
        on_router_loop(cluster, lambda: cluster.router.pool.unsubscribe(rid))
        sock.close()
        listener.close()
    assert prefill.alive() and not prefill.crashed
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=12,
                                                                                           ignore_eos=True))
    out = cluster.stub.GenerateUnary(req, timeout=60)
    assert list(out.token_ids) == hf_greedy(hf_tiny, prompt, 12)[0]
    cluster.wait_pages_free()
