"""Ownership of KV pages: reference counts, the free list, and the prefix cache's LRU.

The scheduler asks `can_allocate` before `allocate`, takes prefix hits with `match_prefix` +
`acquire`, and gives pages back with `release`. Invariants:
  - a page is in exactly one of: referenced (ref_count > 0), free, or evictable;
  - evictable pages hold a registered hash (their KV is reusable) and no references; they are
    reclaimed least-recently-released first, only when the free list is empty;
  - `num_free_pages` counts free + evictable, i.e. what `allocate` can hand out.
After every request has finished, `num_referenced_pages == 0`: every page is free or held only
by the prefix cache (tests check this).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

from engine.block_events import BlockEventLog


class OutOfPagesError(RuntimeError):
    pass


class PageManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_to_page: dict[bytes, int] = {}
        self._page_to_hash: dict[int, bytes] = {}
        self.prefix_queries_tokens = 0  # prompt tokens looked up (for the hit rate)
        self.prefix_hit_tokens = 0
        # Every hash registered or dropped, for the router's KV block index (None: nobody listens).
        self.block_events: BlockEventLog | None = None

    # -- capacity ---------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_referenced_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        return len(self._page_to_hash)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_free_pages

    def allocate(self, num_pages: int) -> list[int]:
        if not self.can_allocate(num_pages):
            raise OutOfPagesError(f"asked for {num_pages} pages, {self.num_free_pages} free")
        pages = []
        for _ in range(num_pages):
            if self._free:
                page = self._free.popleft()
            else:  # reclaim the least recently used cached page
                page, _ = self._evictable.popitem(last=False)
                self._forget(page)
            self.ref_counts[page] = 1
            pages.append(page)
        return pages

    # -- sharing ----------------------------------------------------------------------------
    def acquire(self, pages: Iterable[int]) -> None:
        """Adds a reference to pages found by `match_prefix`."""
        for page in pages:
            if self.ref_counts[page] == 0:
                del self._evictable[page]
            self.ref_counts[page] += 1

    def release(self, pages: Iterable[int]) -> None:
        """Drops one reference per page; unreferenced pages become evictable or free."""
        for page in pages:
            if self.ref_counts[page] <= 0:
                raise RuntimeError(f"page {page} released more times than it was taken")
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                if page in self._page_to_hash:
                    self._evictable[page] = None  # most recently used end
                else:
                    self._free.append(page)

    # -- prefix cache -----------------------------------------------------------------------
    def match_prefix(self, page_hashes: Sequence[bytes]) -> list[int]:
        """Pages already holding the leading full pages with these hashes (longest run)."""
        if not self.enable_prefix_caching:
            return []
        pages = []
        for h in page_hashes:
            page = self._hash_to_page.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def num_evictable_among(self, pages: Iterable[int]) -> int:
        """How many of these pages `acquire` would take out of the free pool."""
        return sum(1 for p in pages if self.ref_counts[p] == 0)

    def register(self, page: int, page_hash: bytes) -> None:
        """Records that `page` now holds the full page with `page_hash` (first writer wins)."""
        if not self.enable_prefix_caching or page_hash in self._hash_to_page or page in self._page_to_hash:
            return
        self._hash_to_page[page_hash] = page
        self._page_to_hash[page] = page_hash
        if self.block_events is not None:
            self.block_events.stored(page_hash)

    def _forget(self, page: int) -> None:
        """Drops a cached page's hash (it is being reused or freed)."""
        page_hash = self._page_to_hash.pop(page)
        del self._hash_to_page[page_hash]
        if self.block_events is not None:
            self.block_events.removed(page_hash)

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries_tokens += num_prompt_tokens
        self.prefix_hit_tokens += num_hit_tokens

    def reset_prefix_cache(self) -> None:
        """Forgets every unreferenced cached page (they return to the free list)."""
        for page in list(self._evictable):
            self._forget(page)
            self._free.append(page)
        self._evictable.clear()
