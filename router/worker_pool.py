"""The router's view of its workers: a command socket to each, their heartbeats, and the
dispatch of worker events to the request they belong to.

One PULL socket (bound on router.worker_event_port) takes every worker's events, each signed
under the cluster's secret (proto/frame_auth.py: one that is not is dropped and counted); Load
heartbeats update health and policy inputs, everything else goes to the waiting request's
queue by the router's internal request id (router/request_ids.py; events for requests that
already ended are dropped).

Membership changes at run time (`pdserve scale`): `add` connects to a new worker, `drain`
stops routing new requests to one while those it holds finish (`in_flight` counts them), and
`remove` forgets it. A draining or unhealthy worker is never offered to the policy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from proto import worker_messages as wm
from proto.flight.recorder import IN, OUT, UNRECORDED, FlightRecorder
from proto.frame_auth import AuthError, ClusterSecret, FrameSigner, FrameVerifier
from router.placement.block_index import BlockIndex
from router.placement.cost_model import LinkCost
from router.policy import WorkerLoad

log = logging.getLogger(__name__)
MAX_EVENT_BYTES = 16 << 20  # the largest event: a Tokens message with up to 1M token ids is ~9 MiB
MAX_EVENTS_PER_FRAME = 1024  # events in one frame (a worker sends a step's, 256 at most: cluster/serving_loop.py)
# A heartbeat is built from state published at most a loop turn before it leaves, every 0.5 s
# (cluster/serving_loop.py): one that arrives this long after a failed transfer knows of it.
SUSPECT_LINK_S = 1.0


@dataclass(frozen=True)
class WorkerEndpoint:
    worker_id: str
    role: str  # "prefill", "decode", "colocated"
    command_address: str  # host:port the worker binds for commands
    # A decode worker's KV endpoint as it bound it (cluster/specs.py WorkerSpec.kv_address:
    # host:kv_port, or dist:<rank>): its Reserved replies must name this and nothing else, or the
    # router would send a prefill worker's KV wherever a reply said (router/attempt.py).
    kv_address: str | None = None
    # torch_dist only (cluster/specs.py): a decode worker's ZMQ KV endpoint, used by the pairs
    # whose torch.distributed link is down; a prefill worker's `dist:<rank>`, the name under
    # which a decode worker reports a link from it that it can no longer hear.
    kv_fallback_address: str | None = None
    kv_source: str | None = None
    # It can flip between prefill and decode (router/role_switch/): `role` is the one it started
    # as, and it has a KV address whatever its role.
    switchable: bool = False

    def __post_init__(self) -> None:
        if (self.role == "decode" or self.switchable) != (self.kv_address is not None):
            raise ValueError(f"worker {self.worker_id}: a decode (or switchable) worker has a KV address and no "
                             f"other has one (role {self.role!r}, kv_address {self.kv_address!r})")
        if self.switchable and self.role not in ("prefill", "decode"):
            raise ValueError(f"worker {self.worker_id}: only prefill and decode workers are switchable")
        if self.kv_fallback_address is not None and self.role != "decode":
            raise ValueError(f"worker {self.worker_id}: only a decode worker has a fallback KV address")
        if self.kv_source is not None and self.role != "prefill":
            raise ValueError(f"worker {self.worker_id}: only a prefill worker is a KV source")


@dataclass
class _Worker:
    """Everything the router knows of one worker: removing a worker is one deletion."""

    endpoint: WorkerEndpoint
    commands: zmq.asyncio.Socket  # PUSH to the worker's command socket
    signer: FrameSigner  # this socket's own: the worker sees its counters in order
    role: str  # the role it takes new work for: its endpoint's, until a flip (router/role_switch/)
    draining: bool = False  # no new requests; the ones it holds go on
    requests: set[str] = field(default_factory=set)  # ids of request attempts it takes part in
    load: wm.Load | None = None  # the last heartbeat
    last_seen: float | None = None  # when it arrived (time.monotonic())
    # KV addresses whose link from this (prefill) worker failed a transfer, -> when: avoided until
    # a heartbeat built after the failure says how the link is (router/attempt.py marks them).
    suspect_links: dict[str, float] = field(default_factory=dict)
    last_flip: dict | None = None  # {"role", "reason", "by", "at"} of its last role flip


class WorkerPool:
    def __init__(self, endpoints: list[WorkerEndpoint], event_address: str, secret: ClusterSecret,
                 heartbeat_timeout_s: float = 3.0, on_reject: Callable[[str], None] = lambda reason: None,
                 page_size: int = 16, recorder: FlightRecorder | None = None) -> None:
        """`secret`: the cluster's, signing every command and checking every event;
        `on_reject(reason)`: a dropped event was counted (the router's metrics); `page_size`:
        the engines' KV page size, which the KV block index hashes prompts by; `recorder`: keeps
        every command sent and request event taken (proto/flight/)."""
        self.recorder = recorder
        self.blocks = BlockIndex(page_size)  # which worker caches which pages (KVBlocks events)
        self._ctx = zmq.asyncio.Context.instance()
        self._secret = secret
        self._verifier = FrameVerifier(secret, event_address)
        self.rejected: dict[str, int] = {}  # dropped events by reason
        self.on_reject = on_reject
        self._workers: dict[str, _Worker] = {}
        for e in endpoints:
            self.add(e)
        self._events = self._ctx.socket(zmq.PULL)
        self._events.setsockopt(zmq.LINGER, 0)
        self._events.setsockopt(zmq.MAXMSGSIZE, MAX_EVENT_BYTES)  # a larger one drops its connection
        self._events.bind(f"tcp://{event_address}")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._waiters: dict[str, asyncio.Queue] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._pump_events())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for worker in self._workers.values():
            worker.commands.close()
        self._events.close()

    # -- membership -----------------------------------------------------------------------------
    @property
    def endpoints(self) -> dict[str, WorkerEndpoint]:
        return {wid: w.endpoint for wid, w in self._workers.items()}

    def add(self, endpoint: WorkerEndpoint) -> None:
        if endpoint.worker_id in self._workers:
            raise ValueError(f"worker {endpoint.worker_id} is already in the pool")
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{endpoint.command_address}")
        self._workers[endpoint.worker_id] = _Worker(endpoint, sock, FrameSigner(self._secret, "router"), endpoint.role)

    def drain(self, worker_id: str) -> None:
        """No new requests for `worker_id`; the ones it holds go on."""
        if worker_id not in self._workers:
            raise KeyError(f"no worker {worker_id} in the pool")
        self._workers[worker_id].draining = True

    async def set_role(self, worker_id: str, role: str, reason: str, by: str) -> None:
        """`worker_id` takes `role`'s work from now on (the caller checked that it may): SetRole goes
        out on its command socket, behind every command routed to it for its old role."""
        worker = self._workers[worker_id]
        await self.send(worker_id, wm.SetRole(worker_id, role, reason))
        worker.role = role
        worker.last_flip = {"role": role, "reason": reason, "by": by, "at": time.time()}

    def role(self, worker_id: str) -> str | None:
        worker = self._workers.get(worker_id)
        return None if worker is None else worker.role

    def remove(self, worker_id: str) -> None:
        self._workers.pop(worker_id).commands.close()
        self.blocks.forget(worker_id)

    def involve(self, request_id: str, worker_id: str) -> None:
        if worker_id in self._workers:
            self._workers[worker_id].requests.add(request_id)

    def uninvolve(self, request_id: str, worker_id: str) -> None:
        """`worker_id` holds nothing more of `request_id` (its transfer is done, or it refused)."""
        if worker_id in self._workers:
            self._workers[worker_id].requests.discard(request_id)

    def release(self, request_id: str) -> None:
        for worker in self._workers.values():
            worker.requests.discard(request_id)

    def kv_address(self, worker_id: str) -> str | None:
        """Where `worker_id` takes KV, as the cluster started it (None: not a decode worker in the pool)."""
        worker = self._workers.get(worker_id)
        return None if worker is None else worker.endpoint.kv_address

    def incarnation(self, worker_id: str) -> str | None:
        """Which process behind `worker_id` sent the last heartbeat (None before the first)."""
        worker = self._workers.get(worker_id)
        return None if worker is None or worker.load is None else worker.load.incarnation

    def in_flight(self, worker_id: str) -> int:
        worker = self._workers.get(worker_id)
        return 0 if worker is None else len(worker.requests)

    def view(self) -> list[dict]:
        """Each worker as the router sees it (for `pdserve status`); a prefill worker with the
        state of its KV link to each decode worker (`kv_links`)."""
        out = []
        for wid, w in sorted(self._workers.items()):
            load, e = w.load, w.endpoint
            entry = {"worker_id": wid, "role": w.role, "command_address": e.command_address,
                     "healthy": self.healthy(wid), "draining": w.draining,
                     "in_flight": len(w.requests), "last_heartbeat_s": None if w.last_seen is None else
                     round(time.monotonic() - w.last_seen, 3), "queued_tokens": load.queued_tokens if load else None,
                     "free_pages": load.free_pages if load else None, "running": load.running if load else None}
            if e.switchable:
                entry.update(started_as=e.role, last_flip=w.last_flip)
            if w.role == "prefill":
                entry["kv_links"] = {d: self.link_view(wid, d) for d in sorted(self._workers)
                                     if self._workers[d].role == "decode"}
            out.append(entry)
        return out

    # -- KV links -------------------------------------------------------------------------------
    def link_error(self, prefill_id: str, address: str) -> str | None:
        """Why `prefill_id` cannot send KV to `address` now (None: as far as the router knows, it
        can). From the workers' heartbeats (the prefill worker's own link, and, on torch_dist,
        the decode worker's receiver) and the transfers that failed since (`suspect`)."""
        prefill = self._workers.get(prefill_id)
        if prefill is None:
            return f"{prefill_id} is not in the pool"
        load = prefill.load
        for link in load.kv_links if load else ():
            if link.address == address and not link.up:
                return link.detail or "down"
        failed_at = prefill.suspect_links.get(address)
        if failed_at is not None:
            if prefill.last_seen is not None and prefill.last_seen - failed_at >= SUSPECT_LINK_S:
                del prefill.suspect_links[address]  # the heartbeat since says the link is up
            else:
                return "a transfer over it just failed"
        source = prefill.endpoint.kv_source
        for decode in self._workers.values():
            if source is not None and decode.endpoint.kv_address == address and decode.load is not None:
                for link in decode.load.kv_links:
                    if link.address == source and not link.up:
                        return f"{decode.endpoint.worker_id} no longer hears it: {link.detail or 'down'}"
        return None

    def kv_route(self, prefill_id: str, decode_id: str) -> str | None:
        """Where `prefill_id` sends `decode_id`'s KV: the decode worker's KV address while that
        link is up, else its ZMQ fallback (torch_dist) while that one is; None: no way now."""
        decode = self._workers.get(decode_id)
        if decode is None or decode.endpoint.kv_address is None:
            return None
        for address in (decode.endpoint.kv_address, decode.endpoint.kv_fallback_address):
            if address is not None and self.link_error(prefill_id, address) is None:
                return address
        return None

    def link_view(self, prefill_id: str, decode_id: str) -> dict:
        """The pair's link for `pdserve status` and the metrics: up, why not, where KV goes."""
        decode = self._workers[decode_id].endpoint
        error = self.link_error(prefill_id, decode.kv_address or "")
        route = self.kv_route(prefill_id, decode_id)
        return {"up": error is None, "error": error, "route": route,
                "fallback": route is not None and route != decode.kv_address}

    def link_states(self) -> list[tuple[str, str, bool]]:
        """(prefill id, decode id, up) of every pair (the router's metric)."""
        decodes = [w for w, x in sorted(self._workers.items()) if x.role == "decode"]
        return [(p, d, self.link_view(p, d)["up"]) for p, x in sorted(self._workers.items())
                if x.role == "prefill" for d in decodes]

    def link_cost(self, prefill_id: str, address: str) -> LinkCost:
        """The link's latency and bandwidth as `prefill_id` measured them (0s: not yet)."""
        worker = self._workers.get(prefill_id)
        for link in worker.load.kv_links if worker is not None and worker.load is not None else ():
            if link.address == address:
                return LinkCost(link.latency_s, link.bytes_per_s)
        return LinkCost()

    def kv_bytes_per_token(self) -> int:
        """One token's KV on the wire, as the workers report it (0 before any heartbeat)."""
        return max((w.load.kv_bytes_per_token for w in self._workers.values() if w.load is not None), default=0)

    def suspect(self, prefill_id: str, address: str) -> None:
        """A transfer from `prefill_id` to `address` failed: avoid that link until a heartbeat
        built after the failure tells its state (a retry must not take it again at once)."""
        worker = self._workers.get(prefill_id)
        if worker is not None:
            worker.suspect_links[address] = time.monotonic()

    # -- health and load ------------------------------------------------------------------------
    def healthy(self, worker_id: str) -> bool:
        worker = self._workers.get(worker_id)
        return (worker is not None and worker.last_seen is not None
                and time.monotonic() - worker.last_seen < self.heartbeat_timeout_s)

    def loads(self, role: str) -> list[WorkerLoad]:
        out = []
        for wid, w in self._workers.items():
            if w.role != role or w.draining:
                continue
            load = w.load
            out.append(WorkerLoad(wid, self.healthy(wid), load.queued_tokens if load else 0,
                                  load.free_pages if load else 0, load.running if load else 0, len(w.requests),
                                  load.prefill_tokens_per_s if load else 0.0, load.decode_step_s if load else 0.0))
        return out

    def all_healthy(self, roles: list[str]) -> bool:
        return all(any(w.healthy for w in self.loads(role)) for role in roles)

    # -- messaging ------------------------------------------------------------------------------
    async def send(self, worker_id: str, message: object) -> None:
        worker = self._workers.get(worker_id)
        if worker is None:
            raise LookupError(f"worker {worker_id} has left the pool")
        encoded = wm.encode(message)
        if self.recorder is not None:
            self.recorder.message(OUT, worker_id, getattr(message, "request_id", None), encoded)
        await worker.commands.send_multipart(worker.signer.wrap(worker.endpoint.command_address, encoded))

    def subscribe(self, request_id: str) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self._waiters[request_id] = queue
        return queue

    def unsubscribe(self, request_id: str) -> None:
        self._waiters.pop(request_id, None)

    def request_ids(self) -> set[str]:
        """Every request id with an event subscription or a worker it involves (on the event loop)."""
        return set(self._waiters).union(*(w.requests for w in self._workers.values()))

    async def _pump_events(self) -> None:
        """Every worker event to where it belongs (a frame carries one or more, one part each: a
        worker sends a step's events together). One bad event is dropped and counted; nothing
        a peer sends ends this task (which would leave every worker looking dead). An event that
        is not signed under the cluster's secret is not even parsed."""
        while True:
            message = await self._events.recv_multipart()
            try:
                _, parts = self._verifier.verify(message)
            except AuthError as exc:
                self.reject(exc.reason, str(exc))
                continue
            if not 1 <= len(parts) <= MAX_EVENTS_PER_FRAME:
                self.reject("malformed", f"an event frame of {len(parts)} events (1 to {MAX_EVENTS_PER_FRAME})")
                continue
            for part in parts:  # a worker's step sends its events as one frame, one part each
                try:
                    event = bytes(part)
                    msg = wm.decode(event)
                    if self.recorder is not None and type(msg).__name__ not in UNRECORDED:
                        self.recorder.message(IN, msg.worker_id, msg.request_id, event)
                    self._dispatch(msg)
                except ValueError as exc:
                    self.reject("malformed", str(exc))
                except Exception as exc:  # noqa: BLE001 - the pump outlives any one event
                    self.reject("error", str(exc))

    def reject(self, reason: str, detail: str) -> None:
        """Counts (and logs) a worker event dropped for `reason`: here, when it cannot be read, or
        by a request's attempt, when what it says cannot be true (router/attempt.py)."""
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        log.warning("dropped a worker event (%s): %s", reason, detail[:200])
        self.on_reject(reason)

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, wm.Load):
            worker = self._workers.get(msg.worker_id)
            if worker is not None:  # a worker not (or no longer) in the pool is not routed to
                restarted = worker.load is not None and worker.load.incarnation != msg.incarnation
                if restarted and worker.endpoint.switchable and msg.role != worker.role:
                    # A flipped worker's replacement starts as its pool's role: route it as that.
                    worker.role = msg.role
                    worker.last_flip = {"role": msg.role, "reason": "restarted as its pool's role", "by": "restart",
                                        "at": time.time()}
                worker.load, worker.last_seen = msg, time.monotonic()
            return
        if isinstance(msg, wm.KVBlocks):
            if msg.worker_id in self._workers:
                self.blocks.apply(msg)
            return
        queue = self._waiters.get(msg.request_id)
        if queue is not None:
            queue.put_nowait(msg)
