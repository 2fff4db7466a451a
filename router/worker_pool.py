"""The router's view of its workers: a command socket to each, their heartbeats, and the
dispatch of worker events to the request they belong to.

One PULL socket (bound on router.worker_event_port) takes every worker's events; Load
heartbeats update health and policy inputs, everything else goes to the waiting request's
queue by request id (events for requests that already ended are dropped).

Membership changes at run time (`pdserve scale`): `add` connects to a new worker, `drain`
stops routing new requests to one while those it holds finish (`in_flight` counts them), and
`remove` forgets it. A draining or unhealthy worker is never offered to the policy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio

from proto import worker_messages as wm
from router.policy import WorkerLoad

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerEndpoint:
    worker_id: str
    role: str  # "prefill", "decode", "colocated"
    command_address: str  # host:port the worker binds for commands


class WorkerPool:
    def __init__(self, endpoints: list[WorkerEndpoint], event_address: str, heartbeat_timeout_s: float = 3.0) -> None:
        self._ctx = zmq.asyncio.Context.instance()
        self.endpoints: dict[str, WorkerEndpoint] = {}
        self._commands: dict[str, zmq.asyncio.Socket] = {}
        self._draining: set[str] = set()
        self._requests: dict[str, set[str]] = {}  # worker id -> ids of request attempts it takes part in
        for e in endpoints:
            self.add(e)
        self._events = self._ctx.socket(zmq.PULL)
        self._events.setsockopt(zmq.LINGER, 0)
        self._events.bind(f"tcp://{event_address}")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._loads: dict[str, wm.Load] = {}
        self._last_seen: dict[str, float] = {}
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
        for sock in [*self._commands.values(), self._events]:
            sock.close()

    # -- membership -----------------------------------------------------------------------------
    def add(self, endpoint: WorkerEndpoint) -> None:
        if endpoint.worker_id in self.endpoints:
            raise ValueError(f"worker {endpoint.worker_id} is already in the pool")
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{endpoint.command_address}")
        self._commands[endpoint.worker_id] = sock
        self.endpoints[endpoint.worker_id] = endpoint

    def drain(self, worker_id: str) -> None:
        """No new requests for `worker_id`; the ones it holds go on."""
        if worker_id not in self.endpoints:
            raise KeyError(f"no worker {worker_id} in the pool")
        self._draining.add(worker_id)

    def remove(self, worker_id: str) -> None:
        self._commands.pop(worker_id).close()
        del self.endpoints[worker_id]
        for table in (self._loads, self._last_seen, self._requests):
            table.pop(worker_id, None)
        self._draining.discard(worker_id)

    def involve(self, request_id: str, worker_id: str) -> None:
        self._requests.setdefault(worker_id, set()).add(request_id)

    def uninvolve(self, request_id: str, worker_id: str) -> None:
        """`worker_id` holds nothing more of `request_id` (its transfer is done, or it refused)."""
        self._requests.get(worker_id, set()).discard(request_id)

    def release(self, request_id: str) -> None:
        for ids in self._requests.values():
            ids.discard(request_id)

    def incarnation(self, worker_id: str) -> str | None:
        """Which process behind `worker_id` sent the last heartbeat (None before the first)."""
        load = self._loads.get(worker_id)
        return None if load is None else load.incarnation

    def in_flight(self, worker_id: str) -> int:
        return len(self._requests.get(worker_id, ()))

    def view(self) -> list[dict]:
        """Each worker as the router sees it (for `pdserve status`)."""
        out = []
        for wid, e in sorted(self.endpoints.items()):
            load = self._loads.get(wid)
            seen = self._last_seen.get(wid)
            out.append({"worker_id": wid, "role": e.role, "command_address": e.command_address,
                        "healthy": self.healthy(wid), "draining": wid in self._draining,
                        "in_flight": self.in_flight(wid), "last_heartbeat_s": None if seen is None else
                        round(time.monotonic() - seen, 3), "queued_tokens": load.queued_tokens if load else None,
                        "free_pages": load.free_pages if load else None, "running": load.running if load else None})
        return out

    # -- health and load ------------------------------------------------------------------------
    def healthy(self, worker_id: str) -> bool:
        seen = self._last_seen.get(worker_id)
        return seen is not None and time.monotonic() - seen < self.heartbeat_timeout_s

    def loads(self, role: str) -> list[WorkerLoad]:
        out = []
        for wid, e in self.endpoints.items():
            if e.role != role or wid in self._draining:
                continue
            load = self._loads.get(wid)
            out.append(WorkerLoad(wid, self.healthy(wid), load.queued_tokens if load else 0,
                                  load.free_pages if load else 0, load.running if load else 0, self.in_flight(wid)))
        return out

    def all_healthy(self, roles: list[str]) -> bool:
        return all(any(w.healthy for w in self.loads(role)) for role in roles)

    # -- messaging ------------------------------------------------------------------------------
    async def send(self, worker_id: str, message: object) -> None:
        sock = self._commands.get(worker_id)
        if sock is None:
            raise LookupError(f"worker {worker_id} has left the pool")
        await sock.send(wm.encode(message))

    def subscribe(self, request_id: str) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self._waiters[request_id] = queue
        return queue

    def unsubscribe(self, request_id: str) -> None:
        self._waiters.pop(request_id, None)

    async def _pump_events(self) -> None:
        while True:
            data = await self._events.recv()
            try:
                msg = wm.decode(data)
            except ValueError as exc:
                log.warning("dropped a bad worker event: %s", exc)
                continue
            if isinstance(msg, wm.Load):
                self._loads[msg.worker_id] = msg
                self._last_seen[msg.worker_id] = time.monotonic()
                continue
            queue = self._waiters.get(msg.request_id)
            if queue is not None:
                queue.put_nowait(msg)
