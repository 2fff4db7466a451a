"""Requests that outlive their deadline: the router's trigger for a flight recorder dump.

Every request has a deadline (its timeout, or the client's gRPC deadline if sooner) and the
router's journey ends it by then. One still held `grace_s` after it is a hang, which is exactly
when the record of what happened to it is worth having: the router's health loop asks
`overdue()` about once a second and dumps its ring for each request it names (router/server.py).
Each request is named once; `end` forgets it, however it ended."""

from __future__ import annotations

import time
from collections.abc import Callable


class DeadlineWatch:
    def __init__(self, grace_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.grace_s, self.clock = grace_s, clock
        self._deadlines: dict[str, float] = {}
        self._named: set[str] = set()

    def start(self, request_id: str, deadline: float) -> None:
        self._deadlines[request_id] = deadline

    def end(self, request_id: str) -> None:
        self._deadlines.pop(request_id, None)
        self._named.discard(request_id)

    def overdue(self) -> list[tuple[str, float]]:
        """(request id, seconds past its deadline) of each request held past deadline + grace
        that was not named before."""
        now = self.clock()
        out = [(rid, now - d) for rid, d in self._deadlines.items()
               if now > d + self.grace_s and rid not in self._named]
        self._named.update(rid for rid, _ in out)
        return out

    def __len__(self) -> int:
        return len(self._deadlines)
