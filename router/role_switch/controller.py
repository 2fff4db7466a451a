"""When to flip a worker between prefill and decode: the router's role-switching controller.

Fed once per finished request (`observe`: its TTFT, which is the prefill side's queue and
compute, router/ttft_stages.py, and its TPOT, which holds the decode side's wait and steps),
kept in a window of its own (router/slo.py SloWindow), asked every `interval_s` (`decide`). A
flip moves capacity from the side with slack to the side under pressure, judged against the SLO
targets over the requests finished in the last `window_s`:
- decode -> prefill when the TTFT p90 is past `high` x the TTFT target (prompts wait for prefill)
  while the TPOT p90 is under `low` x the TPOT target (the decode workers have time to spare);
- prefill -> decode when the TPOT p90 is past `high` x its target while the TTFT p90 is under
  `low` x its target.
Both under pressure is a capacity problem (the autoscaler's, `pdserve scale`), not a mix one:
no flip. Hysteresis, so a steady load never makes it flip back and forth: the two bands (`high`
above `low`), a condition must hold `sustain_s` on every look, the samples start again after a
flip (the old mix's requests say nothing of the new one), `cooldown_s` between flips, and at
most `max_flips` in any `flip_window_s` (by default 2 in 5 minutes, whatever the load does).
Pure logic on an injected clock: tests script its inputs (tests/unit/test_role_controller.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from configs.role_switching import RoleSwitchingConfig
from router.slo import SloWindow


@dataclass(frozen=True)
class Candidate:
    """A switchable worker as the router sees it now."""

    worker_id: str
    role: str  # the role it takes new work for
    healthy: bool
    running: int  # sequences decoding on it
    queued_tokens: int  # prompt tokens waiting for its prefill


@dataclass(frozen=True)
class Flip:
    worker_id: str
    role: str  # the role it flips to
    reason: str


class RoleController:
    def __init__(self, config: RoleSwitchingConfig, ttft_target_s: float, tpot_target_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.ttft_target_s, self.tpot_target_s = ttft_target_s, tpot_target_s
        self.clock = clock
        self._window = SloWindow(config.window_s, clock)  # the recent requests' TTFT and TPOT
        self._since: dict[str, float] = {}  # direction ("prefill"/"decode": the role short of workers) -> held since
        self._flips: deque[float] = deque()  # when the recent flips were made

    def observe(self, ttft_s: float, tpot_s: float | None) -> None:
        """A finished request: its TTFT and TPOT (None: one token)."""
        self._window.record(True, ttft_s, tpot_s)

    def flipped(self) -> None:
        """A flip was made (by this controller or by hand): the samples and the timers start again."""
        self._flips.append(self.clock())
        self._window.clear()
        self._since.clear()

    def decide(self, workers: Sequence[Candidate]) -> Flip | None:
        """The flip to make now, if any (the caller makes it, then calls `flipped`)."""
        now, c = self.clock(), self.config
        while self._flips and self._flips[0] < now - c.flip_window_s:
            self._flips.popleft()
        recent = self._window.latency(0.9)
        requests = int(recent["requests"] or 0)
        if requests < c.min_samples:
            self._since.clear()
            return None
        ttft, tpot = recent["ttft_s"] or 0.0, recent["tpot_s"] or 0.0
        ttft_share, tpot_share = ttft / self.ttft_target_s, tpot / self.tpot_target_s
        short = None  # the role short of workers
        if ttft_share > c.high and tpot_share < c.low:
            short = "prefill"
        elif tpot_share > c.high and ttft_share < c.low:
            short = "decode"
        for direction in list(self._since):
            if direction != short:
                del self._since[direction]
        if short is None:
            return None
        since = self._since.setdefault(short, now)
        if now - since < c.sustain_s:
            return None
        if self._flips and now - self._flips[-1] < c.cooldown_s or len(self._flips) >= c.max_flips:
            return None
        donor = "decode" if short == "prefill" else "prefill"
        donors = [w for w in workers if w.role == donor and w.healthy]
        if len(donors) - 1 < max(c.min_workers_per_role, 1 if donor == "decode" else 0):
            return None
        # The donor with the least of its old role's work left to finish.
        worker = min(donors, key=lambda w: (w.running, w.worker_id) if donor == "decode"
                     else (w.queued_tokens, w.worker_id))
        reason = (f"TTFT p90 {ttft:.3f} s ({ttft_share:.0%} of target), TPOT p90 {tpot * 1000:.1f} ms "
                  f"({tpot_share:.0%} of target) over {requests} requests: {short} short of workers")
        return Flip(worker.worker_id, short, reason)
