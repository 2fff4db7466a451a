"""The router's map of which worker holds which KV pages in its prefix cache, from the workers'
own KV block events (proto/worker_messages.py KVBlocks, engine/block_events.py), so a prompt
can go where its prefix is: the decode worker that can compute only the suffix, the prefill
worker that need not recompute it, the decode reservation with the fewest pages to receive.

A prompt's pages are hashed as the workers hash them (proto/block_hash.py, the cluster's page
size); a worker's hit is the run of leading pages it holds. Bounded: at most `capacity` (hash,
worker) entries, the least recently stored or looked-up dropped first. Never trusted for
correctness: a lost, duplicated or reordered event makes an entry wrong, which costs a cache
miss (the engine matches the pages' full hashes itself). To keep wrong entries few, a worker
whose events skip a sequence number, restart under a new incarnation, or say they lost changes
is forgotten at once; `forget` also drops a worker that left the pool.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from proto import worker_messages as wm
from proto.block_hash import hash_full_pages, short_hash


class BlockIndex:
    def __init__(self, page_size: int, capacity: int = 1 << 20) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.capacity = capacity
        self._entries: OrderedDict[tuple[int, str], None] = OrderedDict()  # (hash, worker), LRU
        self._by_hash: dict[int, set[str]] = {}
        self._by_worker: dict[str, set[int]] = {}
        self._last: dict[str, tuple[str, int]] = {}  # worker -> (incarnation, last seq applied)
        self.num_resets = 0  # workers forgotten for a gap, a restart or lost changes

    def __len__(self) -> int:
        return len(self._entries)

    def apply(self, event: wm.KVBlocks) -> None:
        last = self._last.get(event.worker_id)
        if event.lost or (last is not None and last != (event.incarnation, event.seq - 1)):
            if last is not None and (last[0] != event.incarnation or event.seq > last[1]):
                self.forget(event.worker_id)
                self.num_resets += 1
            elif last is not None:  # a duplicate or a late one: already applied, or older than what is
                return
        self._last[event.worker_id] = (event.incarnation, event.seq)
        for h in event.removed:
            self._drop(h, event.worker_id)
        for h in event.stored:
            key = (h, event.worker_id)
            self._entries[key] = None
            self._entries.move_to_end(key)
            self._by_hash.setdefault(h, set()).add(event.worker_id)
            self._by_worker.setdefault(event.worker_id, set()).add(h)
        while len(self._entries) > self.capacity:
            (h, worker), _ = self._entries.popitem(last=False)
            self._unlink(h, worker)

    def forget(self, worker_id: str) -> None:
        for h in list(self._by_worker.get(worker_id, ())):
            del self._entries[(h, worker_id)]
            self._unlink(h, worker_id)
        self._last.pop(worker_id, None)

    def prompt_hashes(self, prompt: Sequence[int]) -> list[int]:
        """The prompt's full pages as the workers hash them."""
        return [short_hash(h) for h in hash_full_pages(list(prompt), self.page_size)]

    def cached_tokens(self, hashes: Sequence[int], worker_ids: Sequence[str]) -> dict[str, int]:
        """Per worker, the prompt tokens it holds: its run of leading pages, in tokens."""
        out = {}
        for worker in worker_ids:
            run = 0
            for h in hashes:
                if worker not in self._by_hash.get(h, ()):
                    break
                self._entries.move_to_end((h, worker))  # looked up: recently useful
                run += 1
            out[worker] = run * self.page_size
        return out

    def _drop(self, h: int, worker: str) -> None:
        if self._entries.pop((h, worker), 0) is None:
            self._unlink(h, worker)

    def _unlink(self, h: int, worker: str) -> None:
        workers = self._by_hash.get(h)
        if workers is not None:
            workers.discard(worker)
            if not workers:
                del self._by_hash[h]
        hashes = self._by_worker.get(worker)
        if hashes is not None:
            hashes.discard(h)
            if not hashes:
                del self._by_worker[worker]
