"""Which (prefill, decode) pair serves a request: pluggable policies over live worker loads.

The router calls `choose_prefill` and `choose_decode` once per request with the latest loads
reported by the workers; `record` tells a policy where a prompt went (for affinity). Unhealthy
or draining workers are never chosen; None means no worker can take the request now.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: str
    healthy: bool = True
    queued_tokens: int = 0  # prefill: prompt tokens accepted and not yet prefilled
    free_pages: int = 0  # decode: KV pages free (or only held by the prefix cache)
    running: int = 0
    in_flight: int = 0  # requests the router has sent here and not seen end: fresher than a heartbeat


class LeastLoadedPolicy:
    """Prefill: fewest queued prompt tokens, then fewest requests in flight. Decode: fewest
    requests in flight, then most free KV pages. Ties: lowest id. Heartbeat loads are up to a
    beat old, so a burst would all see the same numbers; the router's own in-flight counts
    spread it."""

    def choose_prefill(self, prompt: Sequence[int], loads: Sequence[WorkerLoad]) -> str | None:
        healthy = [w for w in loads if w.healthy]
        return min(healthy, key=lambda w: (w.queued_tokens, w.in_flight, w.worker_id)).worker_id if healthy else None

    def choose_decode(self, prompt: Sequence[int], loads: Sequence[WorkerLoad]) -> str | None:
        healthy = [w for w in loads if w.healthy]
        return min(healthy, key=lambda w: (w.in_flight, -w.free_pages, w.worker_id)).worker_id if healthy else None

    def record(self, prompt: Sequence[int], prefill_worker: str) -> None:
        pass


class PrefixAffinityPolicy(LeastLoadedPolicy):
    """Sends a prompt to the prefill worker that last served its longest known prefix (whose
    prefix cache likely still holds it), unless that worker is busier than the least loaded
    one by more than `max_extra_tokens`: affinity must not pile everything on one worker."""

    def __init__(self, block_size: int = 16, max_extra_tokens: int = 4096, capacity: int = 100_000) -> None:
        self.block_size = block_size
        self.max_extra_tokens = max_extra_tokens
        self.capacity = capacity
        self._owner: OrderedDict[int, str] = OrderedDict()  # chained block hash -> worker, LRU

    def _block_hashes(self, prompt: Sequence[int]) -> list[int]:
        hashes, parent = [], 0
        for start in range(0, len(prompt) - self.block_size + 1, self.block_size):
            parent = hash((parent, tuple(prompt[start : start + self.block_size])))
            hashes.append(parent)
        return hashes

    def choose_prefill(self, prompt: Sequence[int], loads: Sequence[WorkerLoad]) -> str | None:
        fallback = super().choose_prefill(prompt, loads)
        if fallback is None:
            return None
        by_id = {w.worker_id: w for w in loads if w.healthy}
        least = by_id[fallback].queued_tokens
        for h in reversed(self._block_hashes(prompt)):  # longest cached prefix first
            owner = self._owner.get(h)
            if owner in by_id and by_id[owner].queued_tokens <= least + self.max_extra_tokens:
                return owner
        return fallback

    def record(self, prompt: Sequence[int], prefill_worker: str) -> None:
        for h in self._block_hashes(prompt):
            self._owner[h] = prefill_worker
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)


def make_policy(name: str) -> LeastLoadedPolicy:
    policies = {"least_loaded": LeastLoadedPolicy, "prefix_affinity": PrefixAffinityPolicy}
    if name not in policies:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(policies)}")
    return policies[name]()
