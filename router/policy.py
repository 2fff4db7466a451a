"""Which worker of a pool serves a request: pluggable policies over live worker loads.

The router's attempt (router/attempt.py) calls `choose_prefill` or `choose_decode` with the
latest loads the workers reported and, per worker, the prompt tokens its prefix cache holds
(`cached`: the KV block index, router/placement/block_index.py, built from the workers' own
events). Unhealthy or draining workers are never chosen; None means no worker can take the
request now. Where a prompt is computed at all (a prefill worker or the decode worker itself)
is router/placement/'s choice; these policies pick the worker within a pool.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: str
    healthy: bool = True
    queued_tokens: int = 0  # prompt tokens accepted and not yet computed (a prefill worker's jobs, a decode worker's own prompts)
    free_pages: int = 0  # decode: KV pages free (or only held by the prefix cache)
    running: int = 0
    in_flight: int = 0  # requests the router has sent here and not seen end: fresher than a heartbeat
    # Measured on the worker's own steps (0 = not yet): the placement cost model's rates.
    prefill_tokens_per_s: float = 0.0
    decode_step_s: float = 0.0


class LeastLoadedPolicy:
    """Prefill: fewest queued prompt tokens, then fewest requests in flight. Decode: fewest
    requests in flight, then most free KV pages. Ties: lowest id. Heartbeat loads are up to a
    beat old, so a burst would all see the same numbers; the router's own in-flight counts
    spread it. Ignores what workers cache."""

    def choose_prefill(self, prompt: Sequence[int], loads: Sequence[WorkerLoad],
                       cached: Mapping[str, int] | None = None) -> str | None:
        healthy = [w for w in loads if w.healthy]
        return min(healthy, key=lambda w: (w.queued_tokens, w.in_flight, w.worker_id)).worker_id if healthy else None

    def choose_decode(self, prompt: Sequence[int], loads: Sequence[WorkerLoad],
                      cached: Mapping[str, int] | None = None) -> str | None:
        healthy = [w for w in loads if w.healthy]
        return min(healthy, key=lambda w: (w.in_flight, -w.free_pages, w.worker_id)).worker_id if healthy else None


class PrefixAffinityPolicy(LeastLoadedPolicy):
    """The worker whose prefix cache holds the longest prefix of the prompt, unless it is busier
    than the least loaded one by more than `max_extra_tokens` queued (prefill) or
    `max_extra_requests` in flight (decode): affinity must not pile everything on one worker.
    A prefill hit is prompt work skipped; a decode hit is pages the transfer skips (and the
    decode worker's own prefill, if the prompt is placed there)."""

    def __init__(self, max_extra_tokens: int = 4096, max_extra_requests: int = 8) -> None:
        self.max_extra_tokens = max_extra_tokens
        self.max_extra_requests = max_extra_requests

    def choose_prefill(self, prompt: Sequence[int], loads: Sequence[WorkerLoad],
                       cached: Mapping[str, int] | None = None) -> str | None:
        fallback = super().choose_prefill(prompt, loads)
        return self._affine(fallback, loads, cached, lambda w: w.queued_tokens, self.max_extra_tokens)

    def choose_decode(self, prompt: Sequence[int], loads: Sequence[WorkerLoad],
                      cached: Mapping[str, int] | None = None) -> str | None:
        fallback = super().choose_decode(prompt, loads)
        return self._affine(fallback, loads, cached, lambda w: w.in_flight, self.max_extra_requests)

    @staticmethod
    def _affine(fallback: str | None, loads: Sequence[WorkerLoad], cached: Mapping[str, int] | None,
                load, max_extra: int) -> str | None:
        if fallback is None or not cached:
            return fallback
        by_id = {w.worker_id: w for w in loads if w.healthy}
        least = load(by_id[fallback])
        candidates = [w for w in by_id.values() if cached.get(w.worker_id, 0) > 0 and load(w) <= least + max_extra]
        if not candidates:
            return fallback
        return min(candidates, key=lambda w: (-cached[w.worker_id], load(w), w.worker_id)).worker_id


def make_policy(name: str) -> LeastLoadedPolicy:
    policies = {"least_loaded": LeastLoadedPolicy, "prefix_affinity": PrefixAffinityPolicy}
    if name not in policies:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(policies)}")
    return policies[name]()
