"""Live goodput: whether a finished request met the router's SLO targets, and the share that
did over a sliding window of recent finishes.

Fed by RouterMetrics.request_finished (router/metrics.py) once per request that finished with
tokens; read by the attainment gauge at scrape time. Definitions follow the field (docs/design.md
§6): TTFT = arrival to first token; TPOT = (E2E - TTFT) / (tokens - 1), so a one-token
request has no TPOT and cannot miss a TPOT target.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


def tpot_of(ttft_s: float | None, e2e_s: float, num_tokens: int) -> float | None:
    """(E2E - TTFT) / (tokens - 1); None for a request with no token or only one."""
    return None if ttft_s is None or num_tokens < 2 else (e2e_s - ttft_s) / (num_tokens - 1)


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
        self._outcomes: deque[tuple[float, bool, float | None, float | None]] = deque()  # (at, met, ttft, tpot)
        self._lock = threading.Lock()

    def record(self, met: bool, ttft_s: float | None = None, tpot_s: float | None = None) -> None:
        with self._lock:
            self._outcomes.append((self.clock(), met, ttft_s, tpot_s))
            self._prune()

    def clear(self) -> None:
        with self._lock:
            self._outcomes.clear()

    def latency(self, q: float = 0.9) -> dict[str, float | int | None]:
        """The window's TTFT and TPOT at quantile `q` (nearest rank; None without samples), and
        how many requests it holds: what the autoscaler compares with its latency targets."""
        with self._lock:
            self._prune()
            outcomes = list(self._outcomes)

        def quantile(values: list[float]) -> float | None:
            values = sorted(values)
            return values[min(len(values) - 1, int(q * len(values)))] if values else None

        return {"requests": len(outcomes), "ttft_s": quantile([o[2] for o in outcomes if o[2] is not None]),
                "tpot_s": quantile([o[3] for o in outcomes if o[3] is not None])}

    def attainment(self) -> float:
        """Share of the window's requests that met every target; NaN when none finished."""
        with self._lock:
            self._prune()
            if not self._outcomes:
                return float("nan")
            return sum(o[1] for o in self._outcomes) / len(self._outcomes)

    def _prune(self) -> None:
        oldest = self.clock() - self.window_s
        while self._outcomes and self._outcomes[0][0] < oldest:
            self._outcomes.popleft()
