"""The router's view of its workers: a command socket to each, their heartbeats, and the
dispatch of worker events to the request they belong to.

One PULL socket (bound on router.worker_event_port) takes every worker's events; Load
heartbeats update health and policy inputs, everything else goes to the waiting request's
queue by request id (events for requests that already ended are dropped).
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
        self.endpoints = {e.worker_id: e for e in endpoints}
        self._commands: dict[str, zmq.asyncio.Socket] = {}
        for e in endpoints:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{e.command_address}")
            self._commands[e.worker_id] = sock
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

    # -- health and load ------------------------------------------------------------------------
    def healthy(self, worker_id: str) -> bool:
        seen = self._last_seen.get(worker_id)
        return seen is not None and time.monotonic() - seen < self.heartbeat_timeout_s

    def loads(self, role: str) -> list[WorkerLoad]:
        out = []
        for wid, e in self.endpoints.items():
            if e.role != role:
                continue
            load = self._loads.get(wid)
            out.append(WorkerLoad(wid, self.healthy(wid), load.queued_tokens if load else 0,
                                  load.free_pages if load else 0, load.running if load else 0))
        return out

    def all_healthy(self, roles: list[str]) -> bool:
        return all(any(w.healthy for w in self.loads(role)) for role in roles)

    # -- messaging ------------------------------------------------------------------------------
    async def send(self, worker_id: str, message: object) -> None:
        await self._commands[worker_id].send(wm.encode(message))

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
