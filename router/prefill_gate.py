"""Router-side credit for prefill work: the queue of prompts waits here, holding nothing.

Used by router/journey.py in disaggregated mode before it reserves decode pages. A decode
reservation has a lease (its pages wait that long for their KV); if the router reserved pages
for every arriving prompt and let them queue on the prefill workers, a burst would queue
longer than the lease and fail requests that were never late, only queued. So a request first
takes a slot here: at most `max_tokens_per_worker` prompt tokens sent and not yet prefilled
(first token not back) on each prefill worker, taken first come first served. Then it reserves
and is sent at once, and the lease only covers a short, bounded prefill queue.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable

from router.token_counts import TokenCounts


class PrefillGate:
    def __init__(self, max_tokens_per_worker: int) -> None:
        if max_tokens_per_worker < 1:
            raise ValueError(f"max_tokens_per_worker must be >= 1, got {max_tokens_per_worker}")
        self.max_tokens_per_worker = max_tokens_per_worker
        self._outstanding = TokenCounts("prefill gate")  # prefill worker -> prompt tokens sent, not yet prefilled
        self._queue: deque[tuple[int, int]] = deque()  # waiting (ticket, prompt tokens), oldest first
        self._tickets = itertools.count()
        self._changed = asyncio.Event()

    def outstanding(self, worker_id: str) -> int:
        return self._outstanding.tokens(worker_id)

    @property
    def outstanding_tokens(self) -> int:
        """Prompt tokens sent to every prefill worker and not yet prefilled (0 when idle)."""
        return self._outstanding.total()

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    @property
    def waiting_tokens(self) -> int:
        """Prompt tokens of every request waiting here (what a newcomer would queue behind)."""
        return sum(n for _, n in self._queue)

    def has_room(self, worker_id: str, num_tokens: int) -> bool:
        """A worker takes a prompt while under budget; an idle one takes any prompt, however long."""
        held = self.outstanding(worker_id)
        return held == 0 or held + num_tokens <= self.max_tokens_per_worker

    async def acquire(self, num_tokens: int, choose: Callable[[set[str]], str | None], deadline: float,
                      on_timeout: Callable[[], Exception], recheck_s: float = 0.05,
                      reconsider: Callable[[int], bool] = lambda ahead_tokens: False) -> str | None:
        """Waits for this request's turn and a worker with room; `choose(full)` is the policy's
        pick among the healthy workers not in `full` (None: there is none). Returns the
        worker, whose outstanding count now includes `num_tokens`: `release` it exactly once.
        `reconsider(ahead_tokens)`, asked at each wake while waiting with the prompt tokens
        queued before this one: True leaves the queue, and acquire returns None (the request
        goes elsewhere: router/placement/). Raises `on_timeout()` at `deadline` (time.monotonic())."""
        ticket = next(self._tickets)
        self._queue.append((ticket, num_tokens))
        try:
            while True:
                if self._queue[0][0] == ticket:
                    worker = choose({w for w in self._outstanding.workers() if not self.has_room(w, num_tokens)})
                    if worker is not None:
                        self._outstanding.add(worker, num_tokens)
                        return worker
                if reconsider(self._ahead(ticket)):
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise on_timeout()
                self._changed.clear()
                try:  # woken by a release or a turn change; rechecked anyway for worker health
                    # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel (router/attempt.py _next)
                    async with asyncio.timeout(min(remaining, recheck_s)):
                        await self._changed.wait()
                except TimeoutError:
                    pass
        finally:
            self._queue.remove((ticket, num_tokens))
            self._changed.set()

    def _ahead(self, ticket: int) -> int:
        ahead = 0
        for t, n in self._queue:
            if t == ticket:
                break
            ahead += n
        return ahead

    def release(self, worker_id: str, num_tokens: int) -> None:
        self._outstanding.done(worker_id, num_tokens)
        self._changed.set()
