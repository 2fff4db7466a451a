"""Live goodput: whether a finished request met the router's SLO targets, and the share that
did over a sliding window of recent finishes.

Fed by RouterMetrics.request_finished (router/metrics.py) once per request that finished with
tokens; read by the attainment gauge at scrape time. Definitions follow the field (DESIGN.md
section 6): TTFT = arrival to first token; TPOT = (E2E - TTFT) / (tokens - 1), so a one-token
request has no TPOT and cannot miss a TPOT target.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class SloTargets:
    ttft_s: float | None = None  # None: no target on this metric
    tpot_s: float | None = None

    @staticmethod
    def from_ms(ttft_ms: float | None, tpot_ms: float | None) -> SloTargets:
        return SloTargets(None if ttft_ms is None else ttft_ms / 1000, None if tpot_ms is None else tpot_ms / 1000)

    def met(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        """Every target that is set is met; with none set, any request that got a token counts."""
        if ttft_s is None:
            return False
        if self.ttft_s is not None and ttft_s > self.ttft_s:
            return False
        return self.tpot_s is None or tpot_s is None or tpot_s <= self.tpot_s


class SloWindow:
    """Outcomes of requests finished in the last `window_s` seconds. Written from the router's
    event loop, read by a scrape (possibly another thread): guarded by a lock."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._outcomes: deque[tuple[float, bool]] = deque()
        self._lock = threading.Lock()

    def record(self, met: bool) -> None:
        with self._lock:
            self._outcomes.append((self.clock(), met))
            self._prune()

    def attainment(self) -> float:
        """Share of the window's requests that met every target; NaN when none finished."""
        with self._lock:
            self._prune()
            if not self._outcomes:
                return float("nan")
            return sum(met for _, met in self._outcomes) / len(self._outcomes)

    def _prune(self) -> None:
        oldest = self.clock() - self.window_s
        while self._outcomes and self._outcomes[0][0] < oldest:
            self._outcomes.popleft()
