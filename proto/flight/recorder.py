"""One component's flight recorder: a bounded ring of what it did to each request.

Where it sits: the router records every command it sends a worker and every worker event it
takes (router/worker_pool.py), a worker every command it takes and every event it sends
(cluster/serving_loop.py); both record the state changes their `EventLog` logs (the log's
`tap`). Heartbeats (Load) and prefix-cache notices (KVBlocks) belong to no request and are not
kept. Recording is one `deque.append` of what is already at hand (a message's msgpack bytes, an
event's fields): nothing is encoded or copied on the serving path; messages are decoded only
when the ring is dumped (dump.py). The ring forgets its oldest entries first, so a dump holds
the last `capacity` things that happened, whatever the uptime.

Thread safety: appends come from the serving thread and (router) the event loop; `entries()`
copies the ring in one C call under the GIL, so a dump never sees a half-made entry.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

# Entry kinds: a message taken in, a message sent out, a state change.
IN, OUT, STATE = "in", "out", "state"
UNRECORDED = frozenset({"Load", "KVBlocks"})  # per-worker, not per-request: heartbeats and cache notices

_live: weakref.WeakSet[FlightRecorder] = weakref.WeakSet()  # every recorder of this process (signals.py)


@dataclass(frozen=True)
class Entry:
    t: float  # wall clock (time.time()): dumps of several processes line up
    kind: str  # IN, OUT or STATE
    request_id: str | None
    peer: str  # the other side of a message (a worker id, "router"); "" for a state change
    payload: bytes | dict  # a message's msgpack bytes (proto/worker_messages.py), or {"event", "fields"}


@dataclass(eq=False)  # compared (and hashed, in the live set) by identity
class FlightRecorder:
    """`component`: router, prefill, decode or colocated; `worker_id`: None for the router;
    `header`: what a replay needs to rebuild this component (its engine settings), kept as is."""

    component: str
    worker_id: str | None = None
    capacity: int = 4096
    header: dict[str, Any] = field(default_factory=dict)
    _ring: deque = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"a flight recorder holds at least 1 entry, not {self.capacity}")
        self._ring = deque(maxlen=self.capacity)
        _live.add(self)

    @property
    def name(self) -> str:
        return self.worker_id or self.component

    def message(self, kind: str, peer: str, request_id: str | None, encoded: bytes) -> None:
        """A message (its wire bytes) taken in (IN) or sent out (OUT) for `request_id`."""
        self._ring.append(Entry(time.time(), kind, request_id, peer, encoded))

    def state(self, event: str, request_id: str | None, fields: dict[str, Any]) -> None:
        """A state change of `request_id` (EventLog's tap): kept only when it names a request."""
        if request_id is not None:
            self._ring.append(Entry(time.time(), STATE, request_id, "", {"event": event, "fields": fields}))

    def entries(self, request_id: str | None = None) -> list[Entry]:
        """The ring, oldest first; only `request_id`'s entries when given."""
        ring = list(self._ring)
        return ring if request_id is None else [e for e in ring if e.request_id == request_id]

    def __len__(self) -> int:
        return len(self._ring)


def live_recorders() -> list[FlightRecorder]:
    return list(_live)
