"""What a worker tells the router of its prefix cache: the full pages it now holds and those it
evicted, as KV block events (proto/worker_messages.py KVBlocks), so the router can send a
prompt where its prefix already is (router/placement/block_index.py).

The page manager (engine/page_manager.py) records each registered and each dropped page hash
here, on the engine's thread; the worker's role takes the net changes at most every
`interval_s` as one message (`take`, from its publish on the same thread). Net: a page stored
and evicted within one interval is sent as removed only. Bounded: past `capacity` pending
changes the oldest are dropped and the message says so (`lost`), and the router forgets what it
knew of this worker rather than trust a partial picture. Events only guide routing: a lost,
late or duplicated one costs a cache miss, never a wrong token (the pages' own hashes are
matched where the pages are).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from proto.block_hash import short_hash


@dataclass(frozen=True)
class BlockChanges:
    seq: int  # 0, 1, 2, ... per log (per worker process)
    stored: tuple[int, ...]  # short hashes of pages now cached
    removed: tuple[int, ...]  # short hashes of pages no longer cached
    lost: bool  # changes were dropped before these (the log overflowed)


class BlockEventLog:
    def __init__(self, interval_s: float = 0.1, capacity: int = 1 << 16,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.capacity = capacity
        self.clock = clock
        self._pending: dict[int, bool] = {}  # short hash -> cached now? (insertion order: oldest first)
        self._lost = False
        self._seq = 0
        self._last_take = float("-inf")

    def stored(self, page_hash: bytes) -> None:
        self._note(short_hash(page_hash), True)

    def removed(self, page_hash: bytes) -> None:
        self._note(short_hash(page_hash), False)

    def _note(self, key: int, cached: bool) -> None:
        self._pending.pop(key, None)  # re-inserted at the newest end
        self._pending[key] = cached
        if len(self._pending) > self.capacity:
            del self._pending[next(iter(self._pending))]
            self._lost = True

    def take(self, force: bool = False) -> BlockChanges | None:
        """The changes since the last take, once `interval_s` has passed (or `force`); None when
        there are none or it is too soon."""
        now = self.clock()
        if not (self._pending or self._lost) or (not force and now - self._last_take < self.interval_s):
            return None
        stored = tuple(k for k, cached in self._pending.items() if cached)
        removed = tuple(k for k, cached in self._pending.items() if not cached)
        changes = BlockChanges(self._seq, stored, removed, self._lost)
        self._pending, self._lost, self._last_take = {}, False, now
        self._seq += 1
        return changes
