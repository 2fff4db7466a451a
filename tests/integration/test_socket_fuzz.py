"""Every internal socket of a live disaggregated cluster takes thousands of random and mutated
messages (random bytes, truncated msgpack, wrong types, NaN and huge numbers, unknown fields,
valid messages for ids nobody holds) and keeps serving: no loop dies, no page stays referenced,
and a normal request afterwards still equals Hugging Face greedy.

Sockets: the router's worker-event socket, each worker's command socket, the decode worker's
KV socket. Seeded; a few seconds. And a well-formed command that only a forger would send: a
Prefill naming a KV destination that is no decode worker of the cluster."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import random
import time
import urllib.request

import msgpack
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from cluster.control import ControlServer, control_request
from cluster.pools import ScaleError
from configs import EngineConfig
from engine.metrics.peak import Peak
from proto import pdserve_pb2 as pb
from proto import worker_messages as wm
from proto.frame_auth import ClusterSecret, FrameSigner, FrameVerifier
from router.worker_pool import MAX_EVENTS_PER_FRAME
from tests.helpers import hf_greedy
from tests.local_cluster import LocalCluster, free_port

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
    c = LocalCluster(tiny_dir, "disaggregated", ENGINE, metrics_peak=Peak.configured(10_000, 1_000))
    yield c
    c.close()


def push(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 5000)  # closed at once after sending: what was sent still goes out
    sock.setsockopt(zmq.SNDTIMEO, 5000)  # a socket whose loop died stops taking messages: zmq.Again
    sock.connect(f"tcp://{address}")
    return sock


class Attacker:
    """Wraps each fuzzed message one way, seeded, and keeps the tally of what each way must be
    counted as: signed with the cluster's secret (an insider's bad message: it must reach, and
    fail, the schema check), or not signed, signed with another secret, altered after signing,
    signed for another socket ("unauthenticated"), or a signed message sent again ("replayed")."""

    def __init__(self, rng: random.Random, secret: ClusterSecret, audience: str, signed_parts: int | None = None):
        """`signed_parts`: how many parts the signature covers (KV frames: the header alone)."""
        self.rng, self.audience, self.signed_parts = rng, audience, signed_parts
        self.signer = FrameSigner(secret, "fuzz")
        self.outsider = FrameSigner(ClusterSecret("not-this-clusters-secret"), "fuzz")
        self.sent: list[list[bytes]] = []  # signed messages, to replay
        self.expected: collections.Counter[str] = collections.Counter()

    def _sign(self, signer: FrameSigner, audience: str, parts: list[bytes]) -> list[bytes]:
        return [signer.sign(audience, parts[: self.signed_parts]), *parts]

    def wrap(self, parts: list[bytes]) -> list[bytes]:
        kind = self.rng.random()
        if kind < 0.5 or not self.sent:
            message = self._sign(self.signer, self.audience, parts)
            self.sent.append(message)
            return message
        if kind < 0.6:
            self.expected["replayed"] += 1
            return self.rng.choice(self.sent)
        self.expected["unauthenticated"] += 1
        if kind < 0.7:
            return parts  # no signature at all
        if kind < 0.8:
            return self._sign(self.outsider, self.audience, parts)
        if kind < 0.9:
            message = self._sign(self.signer, self.audience, parts)
            message[1] = message[1][:-1] + bytes([message[1][-1] ^ 1]) if message[1] else b"x"  # altered
            return message
        return self._sign(self.signer, "127.0.0.1:1", parts)  # recorded on another socket


def wait_for(check, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.05)


def counted(host, wanted: dict, timeout_s: float = 15.0) -> dict:
    """The host's rejected-message counts once each of `wanted` is reached (its loops take a
    moment to drain what was sent)."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = host.rejected_messages()
        if all(counts.get(k, 0) >= n for k, n in wanted.items()) or time.monotonic() > deadline:
            return counts
        time.sleep(0.05)


def test_every_internal_socket_survives_fuzzing_and_counts_what_it_refuses(cluster, hf_tiny):
    rng = random.Random(1234)
    decode = next(h for h in cluster.hosts if h.role == "decode")
    targets = {"router": cluster.router.event_address}
    targets |= {h.worker_id: h.command_address for h in cluster.hosts}
    attackers = {name: Attacker(rng, cluster.secret, address) for name, address in targets.items()}
    kv_address = f"127.0.0.1:{decode.spec.kv_port}"
    kv_attacker = Attacker(rng, cluster.secret, kv_address, signed_parts=1)  # checksum on: the header is signed
    sockets = {name: push(address) for name, address in targets.items()}
    kv = push(kv_address)
    try:
        for _ in range(NUM_PER_SOCKET):
            for name, sock in sockets.items():
                sock.send_multipart(attackers[name].wrap([mutated(rng)]))
            kv.send_multipart(kv_attacker.wrap(kv_frame(rng)))
    finally:
        for sock in [*sockets.values(), kv]:
            sock.close()
    # Exactly what was sent without the secret (or replayed) is counted as such, on every socket.
    pool = cluster.router.pool
    wait_for(lambda: all(pool.rejected.get(r, 0) >= n for r, n in attackers["router"].expected.items()))
    for host in cluster.hosts:
        wanted = {("commands", r): n for r, n in attackers[host.worker_id].expected.items()}
        if host is decode:
            wanted |= {("kv", r): n for r, n in kv_attacker.expected.items()}
        counts = counted(host, wanted)
        assert {k: counts[k] for k in wanted} == wanted, host.worker_id
        assert counts["commands", "malformed"] > NUM_PER_SOCKET // 4  # the insider's messages met the schema
    assert {r: pool.rejected[r] for r in ("unauthenticated", "replayed")} == dict(attackers["router"].expected)
    assert pool.rejected["malformed"] > NUM_PER_SOCKET // 4
    assert decode.rejected_messages()["kv", "malformed"] > 0
    # The worker's /metrics shows the same counts, under the router's metric name.
    text = urllib.request.urlopen(f"http://{cluster.metrics_address('decode-0')}/metrics", timeout=10).read().decode()
    samples = {(s.labels["socket"], s.labels["reason"]): s.value for f in text_string_to_metric_families(text)
               for s in f.samples if s.name == "pdserve_rejected_messages_total"}
    assert samples[("kv", "unauthenticated")] == kv_attacker.expected["unauthenticated"]
    assert samples[("commands", "replayed")] == attackers["decode-0"].expected["replayed"]
    assert all(h.alive() and not h.crashed for h in cluster.hosts), [h.state() for h in cluster.hosts]
    assert cluster.router.pool.all_healthy(["prefill", "decode"])
    prompt = [0] + list(range(300, 340))
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=12,
                                                                                           ignore_eos=True))
    out = cluster.stub.GenerateUnary(req, timeout=60)
    assert list(out.token_ids) == hf_greedy(hf_tiny, prompt, 12)[0]
    cluster.wait_pages_free()


def test_well_formed_messages_without_the_secret_get_nothing_done(cluster, hf_tiny):
    """A valid Abort for a live request (to both workers), a valid Tokens event ending it (to the
    router) and a valid KV done frame for it, each sent unsigned, signed with another cluster's
    secret, or altered after signing: the request still ends as HF greedy, and each is counted,
    not acted on."""
    prefill, decode = (next(h for h in cluster.hosts if h.role == role) for role in ("prefill", "decode"))
    outsider = FrameSigner(ClusterSecret("another-clusters-secret"), "router")
    before = {h.worker_id: h.rejected_messages() for h in cluster.hosts}
    router_before = dict(cluster.router.pool.rejected)
    prompt = [0] + list(range(400, 440))
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), request_id="forged-events",
                             sampling=pb.SamplingParams(max_tokens=64, ignore_eos=True))
    stream = cluster.stub.Generate(req, timeout=60)
    first = next(stream)  # the request is live on both workers now
    rid = on_router_loop(cluster, lambda: cluster.router.live_ids.internal_id("forged-events"))
    assert rid is not None
    sends = {
        prefill.command_address: wm.encode(wm.Abort(rid)),
        decode.command_address: wm.encode(wm.Abort(rid)),
        cluster.router.event_address: wm.encode(wm.Tokens(rid, "decode-0", (1, 2, 3), (), True, "stop")),
    }
    for address, data in sends.items():
        sock = push(address)
        signed = FrameSigner(cluster.secret, "router").wrap(address, data)
        for message in ([data], outsider.wrap(address, data), signed[:1] + [data + b"\0"]):
            sock.send_multipart(message)
        sock.close()
    kv = push(f"127.0.0.1:{decode.spec.kv_port}")
    kv.send_multipart([outsider.sign(decode.spec.kv_address, [b"h"]), msgpack.packb({"kind": "done",
                                                                                     "request_id": rid})])
    kv.close()
    tokens = list(first.token_ids) + [t for r in stream for t in r.token_ids]
    assert tokens == hf_greedy(hf_tiny, prompt, 64)[0]
    wait_for(lambda: cluster.router.pool.rejected.get("unauthenticated", 0) == router_before.get(
        "unauthenticated", 0) + 3)
    for host, extra in ((prefill, {("commands", "unauthenticated"): 3}),
                        (decode, {("commands", "unauthenticated"): 3, ("kv", "unauthenticated"): 1})):
        wanted = {k: before[host.worker_id].get(k, 0) + n for k, n in extra.items()}
        counts = counted(host, wanted)
        assert {k: counts[k] for k in wanted} == wanted, host.worker_id
    cluster.wait_pages_free()


def test_a_signed_event_frame_is_taken_part_by_part_and_bounded(cluster):
    """A step's events come as one frame, one part each (cluster/serving_loop.py EventSink.batch):
    the router reads every part on its own, so two malformed parts cost two counts and not the
    frame's valid event; a frame of no events, or of more than the router takes, is one count."""
    pool, address = cluster.router.pool, cluster.router.event_address
    before = pool.rejected.get("malformed", 0)
    signer = FrameSigner(cluster.secret, "decode-0")
    load = wm.encode(wm.Load("no-such-worker", "decode", 0, 0, 0))  # authentic, well formed: dropped silently
    sock = push(address)
    try:
        sock.send_multipart(signer.wrap(address, b"\x01not msgpack", load, msgpack.packb({"kind": "nonsense"})))
        sock.send_multipart(signer.wrap(address))
        sock.send_multipart(signer.wrap(address, *[load] * (MAX_EVENTS_PER_FRAME + 1)))
    finally:
        sock.close()
    wait_for(lambda: pool.rejected.get("malformed", 0) >= before + 4)
    time.sleep(0.2)  # nothing more is counted: the valid part was not
    assert pool.rejected.get("malformed", 0) == before + 4
    assert cluster.router.pool.all_healthy(["prefill", "decode"])


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
        # Signed with the cluster's secret: a buggy or compromised insider, not an outsider.
        sock.send_multipart(FrameSigner(cluster.secret, "router").wrap(prefill.command_address, wm.encode(forged)))
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


def test_a_signed_malformed_command_is_answered_with_an_error_naming_its_bad_field(cluster):
    """A correctly signed ReserveKV whose sampling.max_tokens is a string: the decode worker
    cannot take it, and says so to the router at once (Failed, stage "command", naming the
    field), so the request fails now instead of waiting out its deadline."""
    decode = next(h for h in cluster.hosts if h.role == "decode")
    rid = "malformed-field"
    events = on_router_loop(cluster, lambda: cluster.router.pool.subscribe(rid))
    sampling = {**dataclasses.asdict(wm.Sampling(max_tokens=4)), "max_tokens": "four"}
    bad = msgpack.packb({**TEMPLATES[5], "request_id": rid, "sampling": sampling})
    sock = push(decode.command_address)
    try:
        sock.send_multipart(FrameSigner(cluster.secret, "router").wrap(decode.command_address, bad))
        failed = on_router_loop(cluster, lambda: asyncio.wait_for(events.get(), 10))
        assert isinstance(failed, wm.Failed) and (failed.worker_id, failed.stage) == (decode.worker_id, "command")
        assert "malformed command: ReserveKV.sampling.max_tokens must be an int" in failed.reason
    finally:
        on_router_loop(cluster, lambda: cluster.router.pool.unsubscribe(rid))
        sock.close()
    assert decode.alive() and decode.page_stats()["referenced"] == 0


class _Pools:
    """What the control server serves, reduced to a record of what it was asked to do."""

    def __init__(self) -> None:
        self.scaled: list[tuple] = []

    def status(self) -> dict:
        return {"mode": "test"}

    def scale(self, role: str, size: int, drain_s: float) -> dict:
        self.scaled.append((role, size))
        return {"role": role, "size": size}

    def set_role(self, worker_id: str, role: str, reason: str) -> dict:
        if worker_id != "decode-1":
            raise ScaleError(f"no worker {worker_id!r}")
        self.scaled.append((worker_id, role, reason))
        return {"worker_id": worker_id, "old": "decode", "role": role, "reason": reason}


def test_the_control_socket_does_only_what_its_cluster_signs():
    """`pdserve scale` / `status` of this cluster work; the same requests unsigned, with another
    secret, replayed, or random bytes, scale nothing, are answered with a refusal signed by the
    cluster (so a client with the wrong secret refuses it too) and counted."""
    secret, rng = ClusterSecret.generate(), random.Random(7)
    address = f"127.0.0.1:{free_port()}"
    pools = _Pools()
    server = ControlServer(pools, address, secret)  # type: ignore[arg-type]
    server.start()
    scale = msgpack.packb({"op": "scale", "sizes": {"decode": 2}}, use_bin_type=True)
    try:
        assert control_request(address, {"op": "status"}, 5, secret)["status"]["mode"] == "test"
        # set_role: its arguments checked, a refusal's reason passed on, a good one done once
        for bad, why in [({"op": "set_role"}, "set_role needs a worker and a role"),
                         ({"op": "set_role", "worker": 7, "role": "prefill"}, "set_role needs a worker and a role"),
                         ({"op": "set_role", "worker": "nope", "role": "prefill"}, "no worker 'nope'")]:
            reply = control_request(address, bad, 5, secret)
            assert not reply["ok"] and why in reply["error"], reply
        assert control_request(address, {"op": "set_role", "worker": "decode-1", "role": "prefill"}, 5,
                               secret)["flip"]["reason"] == "asked"
        assert pools.scaled == [("decode-1", "prefill", "asked")]
        pools.scaled.clear()
        with pytest.raises(PermissionError, match="not from this cluster"):
            control_request(address, {"op": "scale", "sizes": {"decode": 3}}, 5, ClusterSecret("x" * 32))
        signed = FrameSigner(secret, "cli").wrap(address, scale)
        messages = [signed, signed, [scale], FrameSigner(secret, "cli").wrap("127.0.0.1:1", scale)]
        messages += [[rng.randbytes(rng.randrange(1, 80)) for _ in range(rng.randrange(1, 3))] for _ in range(200)]
        for message in messages:
            sock = zmq.Context.instance().socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{address}")
            sock.send_multipart(message)
            assert sock.poll(5000)
            reply = sock.recv_multipart()
            sock.close()
            FrameVerifier(secret, address + "#reply").verify(reply)  # every answer is the cluster's
        assert pools.scaled == [("decode", 2)]  # the one signed request, once
        status = control_request(address, {"op": "status"}, 5, secret)["status"]
    finally:
        server.close()
    assert status["control_rejected"] == {"unauthenticated": 1 + 1 + 1 + 200, "replayed": 1}
