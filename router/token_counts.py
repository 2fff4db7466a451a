"""Prompt tokens the router has sent to each worker and not yet seen computed.

One counter, two owners: the prefill gate (router/prefill_gate.py: a prefill worker's share of
the router's prefill credit) and the placer's local queue (router/placement/placer.py: prompts
placed on a decode worker). Each request adds its prompt once and takes it away once; taking
away more than was added is a bookkeeping bug, raised, never clamped, so a leak or a double
release shows at once instead of skewing every later placement.
"""

from __future__ import annotations


class TokenCounts:
    def __init__(self, name: str) -> None:
        self.name = name  # says whose counts in an error
        self._tokens: dict[str, int] = {}

    def tokens(self, worker_id: str) -> int:
        return self._tokens.get(worker_id, 0)

    def workers(self) -> set[str]:
        """The workers holding any tokens now."""
        return set(self._tokens)

    def total(self) -> int:
        return sum(self._tokens.values())

    def add(self, worker_id: str, num_tokens: int) -> None:
        self._tokens[worker_id] = self.tokens(worker_id) + num_tokens

    def done(self, worker_id: str, num_tokens: int) -> None:
        left = self.tokens(worker_id) - num_tokens
        if left < 0:
            raise RuntimeError(f"{self.name}: {worker_id} released {num_tokens} tokens it was not holding")
        if left:
            self._tokens[worker_id] = left
        else:
            self._tokens.pop(worker_id, None)
