"""One request's time to first token, split into stages on the router's clock.

Kept by the request's Stream (router/journey_state.py) across attempts and marked by the
attempt that reaches each moment (router/attempt.py): the prompt sent to the worker that
computes it, the first token back, and on a remote placement the prefill worker's report that
the KV was sent and the decode worker's first token. `respond` puts the result in the final
Usage (`ttft_breakdown`, `kv_handoff`); the router observes each stage in
`pdserve_request_stage_seconds{stage}` (router/metrics.py).

Why the KV is not in the TTFT: a prefill worker streams the first token as soon as it has
computed it (proto/worker_messages.py), so the transfer and the decode worker's admission run
while the client reads that token, and what they cost shows as the gap to the second token,
reported as the hand-off. Every stage is a difference of two marks of one monotonic clock, so
the stages of the TTFT sum to it exactly (up to float rounding).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TtftBreakdown:
    queued_s: float = 0.0  # admitted -> sent to the computing worker (lost attempts included)
    prefill_s: float = 0.0  # sent -> first token: the worker's queue plus its compute
    transfer_s: float = 0.0  # KV transfer the first token waited for: none in pdserve (see above)
    decode_wait_s: float = 0.0  # decode admission the first token waited for: none either


@dataclass(frozen=True)
class KvHandoff:
    transfer_s: float  # first token -> the KV reported sent (what did not overlap the compute)
    decode_wait_s: float  # KV sent -> the decode worker's first token


@dataclass
class StageClock:
    """Marks of one request's moments (time.monotonic()); each is set once, except `sent`,
    which a new attempt moves while no token has reached the client."""

    start: float = field(default_factory=time.monotonic)
    sent: float | None = None
    first_token: float | None = None
    kv_sent: float | None = None  # remote only
    decode_first: float | None = None  # remote only: the decode worker's first tokens

    def mark_sent(self, now: float | None = None) -> None:
        if self.first_token is None:
            self.sent = time.monotonic() if now is None else now

    def mark_first_token(self, now: float | None = None) -> float:
        """Returns the TTFT (first call) or the one already measured."""
        if self.first_token is None:
            self.first_token = time.monotonic() if now is None else now
        return self.first_token - self.start

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    def mark_kv_sent(self, now: float | None = None) -> None:
        if self.kv_sent is None and self.first_token is not None:
            self.kv_sent = time.monotonic() if now is None else now

    def mark_decode_first(self, now: float | None = None) -> None:
        if self.decode_first is None and self.first_token is not None:
            self.decode_first = time.monotonic() if now is None else now

    def ttft_breakdown(self) -> TtftBreakdown | None:
        """None until the first token; its stages sum to first_token - start."""
        if self.first_token is None:
            return None
        sent = self.start if self.sent is None else min(self.sent, self.first_token)
        return TtftBreakdown(queued_s=sent - self.start, prefill_s=self.first_token - sent)

    def kv_handoff(self) -> KvHandoff | None:
        """None unless a decode worker's token followed a prefill worker's first token; its two
        stages sum to decode_first - first_token. The decode worker may be heard from before the
        prefill worker's report (two sockets): then the transfer ends at its first token."""
        if self.first_token is None or self.decode_first is None:
            return None
        kv_sent = self.decode_first if self.kv_sent is None else min(self.kv_sent, self.decode_first)
        return KvHandoff(transfer_s=kv_sent - self.first_token, decode_wait_s=self.decode_first - kv_sent)
