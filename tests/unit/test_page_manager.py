"""PageManager reference counting, free pool, prefix cache + LRU; prefix_cache hashing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.page_manager import OutOfPagesError, PageManager
from proto.block_hash import ROOT_HASH, hash_full_pages, hash_page

REPO = Path(__file__).resolve().parents[2]


def check_invariants(pm: PageManager) -> None:
    """Each page is in exactly one of referenced / free / evictable; counters agree."""
    referenced = {p for p in range(pm.num_pages) if pm.ref_counts[p] > 0}
    free = set(pm._free)
    evictable = set(pm._evictable)
    assert len(free) == len(pm._free), "a page is on the free list twice"
    assert not (referenced & free) and not (referenced & evictable) and not (free & evictable)
    assert referenced | free | evictable == set(range(pm.num_pages))
    assert all(c >= 0 for c in pm.ref_counts)
    assert pm.num_free_pages == len(free) + len(evictable)
    assert pm.num_referenced_pages == len(referenced)
    assert pm.num_cached_pages == len(pm._page_to_hash) == len(pm._hash_to_page)
    for page in evictable:  # evictable pages always carry a hash
        assert page in pm._page_to_hash
    for page in free:  # free pages never do
        assert page not in pm._page_to_hash
    for h, page in pm._hash_to_page.items():
        assert pm._page_to_hash[page] == h


def h(i: int) -> bytes:
    return hash_page(ROOT_HASH, [i])


# -- allocation and reference counts ----------------------------------------------------------
def test_fresh_manager_all_free():
    pm = PageManager(8, 4)
    assert pm.num_free_pages == 8
    assert pm.num_referenced_pages == 0
    assert pm.num_cached_pages == 0
    check_invariants(pm)


def test_allocate_gives_distinct_pages_with_ref_one():
    pm = PageManager(8, 4)
    pages = pm.allocate(5)
    assert len(pages) == 5 and len(set(pages)) == 5
    assert all(0 <= p < 8 for p in pages)
    assert all(pm.ref_counts[p] == 1 for p in pages)
    assert pm.num_free_pages == 3
    assert pm.num_referenced_pages == 5
    more = pm.allocate(3)
    assert set(more).isdisjoint(pages)
    assert pm.num_free_pages == 0
    check_invariants(pm)


def test_allocate_zero_is_noop():
    pm = PageManager(2, 4)
    assert pm.allocate(0) == []
    assert pm.num_free_pages == 2


def test_can_allocate_boundary():
    pm = PageManager(4, 4)
    assert pm.can_allocate(0)
    assert pm.can_allocate(4)
    assert not pm.can_allocate(5)
    pm.allocate(3)
    assert pm.can_allocate(1)
    assert not pm.can_allocate(2)


def test_out_of_pages_error_message_and_no_side_effects():
    pm = PageManager(4, 4)
    pm.allocate(3)
    with pytest.raises(OutOfPagesError, match=r"asked for 2 pages, 1 free"):
        pm.allocate(2)
    # A failed allocation takes nothing.
    assert pm.num_free_pages == 1
    check_invariants(pm)
    assert issubclass(OutOfPagesError, RuntimeError)


def test_release_returns_pages_to_pool():
    pm = PageManager(4, 4)
    pages = pm.allocate(4)
    pm.release(pages[:2])
    assert pm.num_free_pages == 2
    assert [pm.ref_counts[p] for p in pages] == [0, 0, 1, 1]
    again = pm.allocate(2)
    assert set(again) == set(pages[:2])
    check_invariants(pm)


def test_acquire_adds_reference_release_needs_all():
    pm = PageManager(4, 4)
    [page] = pm.allocate(1)
    pm.acquire([page])
    pm.acquire([page])
    assert pm.ref_counts[page] == 3
    pm.release([page])
    pm.release([page])
    assert pm.ref_counts[page] == 1
    assert pm.num_referenced_pages == 1
    pm.release([page])
    assert pm.ref_counts[page] == 0
    assert pm.num_referenced_pages == 0
    check_invariants(pm)


def test_double_release_raises():
    pm = PageManager(4, 4)
    [page] = pm.allocate(1)
    pm.release([page])
    with pytest.raises(RuntimeError, match=rf"page {page} released more times than it was taken"):
        pm.release([page])
    # The failed release did not corrupt the pool.
    assert pm.num_free_pages == 4
    check_invariants(pm)


def test_release_never_allocated_page_raises():
    pm = PageManager(4, 4)
    with pytest.raises(RuntimeError):
        pm.release([2])


# -- prefix cache -----------------------------------------------------------------------------
def test_register_and_match_prefix_longest_run():
    pm = PageManager(8, 4)
    pages = pm.allocate(3)
    for page, i in zip(pages, range(3)):
        pm.register(page, h(i))
    assert pm.num_cached_pages == 3
    assert pm.match_prefix([h(0), h(1), h(2)]) == pages
    assert pm.match_prefix([h(0), h(1)]) == pages[:2]
    # Stops at the first miss, even if later hashes are known.
    assert pm.match_prefix([h(0), h(99), h(2)]) == pages[:1]
    assert pm.match_prefix([h(99), h(0)]) == []
    assert pm.match_prefix([]) == []
    # Matching takes no reference.
    assert all(pm.ref_counts[p] == 1 for p in pages)
    check_invariants(pm)


def test_register_first_writer_wins():
    pm = PageManager(4, 4)
    a, b = pm.allocate(2)
    pm.register(a, h(0))
    pm.register(b, h(0))  # same content elsewhere: ignored
    pm.register(a, h(1))  # page already has a hash: ignored
    assert pm.match_prefix([h(0)]) == [a]
    assert pm.match_prefix([h(1)]) == []
    assert pm.num_cached_pages == 1
    # b was never registered, so it goes to the free list, not the evictable pool.
    pm.release([b])
    assert b in pm._free
    check_invariants(pm)


def test_prefix_caching_disabled():
    pm = PageManager(4, 4, enable_prefix_caching=False)
    [a] = pm.allocate(1)
    pm.register(a, h(0))
    assert pm.num_cached_pages == 0
    assert pm.match_prefix([h(0)]) == []
    pm.release([a])
    assert pm.num_free_pages == 4
    check_invariants(pm)


def test_released_cached_page_stays_matchable_and_counts_as_free():
    pm = PageManager(4, 4)
    [a] = pm.allocate(1)
    pm.register(a, h(0))
    pm.release([a])
    assert pm.ref_counts[a] == 0
    assert pm.num_free_pages == 4  # evictable pages can be handed out
    assert pm.num_referenced_pages == 0
    assert pm.num_cached_pages == 1
    assert pm.match_prefix([h(0)]) == [a]
    assert pm.num_evictable_among([a]) == 1
    check_invariants(pm)


def test_acquire_evictable_removes_it_from_free_pool():
    pm = PageManager(3, 4)
    a, b = pm.allocate(2)
    pm.register(a, h(0))
    pm.release([a, b])
    assert pm.num_free_pages == 3
    hits = pm.match_prefix([h(0)])
    assert hits == [a]
    pm.acquire(hits)
    assert pm.ref_counts[a] == 1
    assert pm.num_free_pages == 2
    assert pm.num_referenced_pages == 1
    assert pm.num_evictable_among(hits) == 0
    # The acquired page can never be handed out by allocate while referenced.
    rest = pm.allocate(2)
    assert a not in rest
    assert not pm.can_allocate(1)
    # And its hash survives (it was not evicted).
    assert pm.match_prefix([h(0)]) == [a]
    check_invariants(pm)


def test_num_evictable_among_counts_unreferenced_only():
    pm = PageManager(4, 4)
    a, b, c = pm.allocate(3)
    for page, i in zip((a, b, c), range(3)):
        pm.register(page, h(i))
    pm.release([a, c])
    assert pm.num_evictable_among([a, b, c]) == 2
    assert pm.num_evictable_among([b]) == 0


def test_free_list_used_before_evicting_cached_pages():
    pm = PageManager(4, 4)
    a, b = pm.allocate(2)
    pm.register(a, h(0))
    pm.register(b, h(1))
    pm.release([a, b])
    # Two plain free pages remain: they are handed out first, the cache survives.
    got = pm.allocate(2)
    assert set(got).isdisjoint({a, b})
    assert pm.num_cached_pages == 2
    assert pm.match_prefix([h(0), h(1)]) == [a, b]
    check_invariants(pm)


def test_lru_eviction_least_recently_released_first():
    pm = PageManager(3, 4)
    a, b, c = pm.allocate(3)
    for page, i in zip((a, b, c), range(3)):
        pm.register(page, h(i))
    # Release order b, c, a: b is least recently released.
    pm.release([b])
    pm.release([c])
    pm.release([a])
    assert pm.num_free_pages == 3
    [first] = pm.allocate(1)
    assert first == b
    assert pm.match_prefix([h(1)]) == []  # its hash is forgotten
    assert pm.match_prefix([h(0)]) == [a]
    assert pm.match_prefix([h(2)]) == [c]
    assert pm.num_cached_pages == 2
    [second] = pm.allocate(1)
    assert second == c
    assert pm.match_prefix([h(2)]) == []
    assert pm.num_cached_pages == 1
    check_invariants(pm)
    # A re-allocated page is a fresh page: it can be registered under a new hash.
    pm.register(second, h(7))
    assert pm.match_prefix([h(7)]) == [second]


def test_lru_reacquire_refreshes_recency():
    pm = PageManager(2, 4)
    a, b = pm.allocate(2)
    pm.register(a, h(0))
    pm.register(b, h(1))
    pm.release([a])
    pm.release([b])
    # Reuse a (a prefix hit), then release it again: now b is the least recently released.
    pm.acquire([a])
    pm.release([a])
    [first] = pm.allocate(1)
    assert first == b
    assert pm.match_prefix([h(0)]) == [a]
    assert pm.match_prefix([h(1)]) == []
    check_invariants(pm)


def test_reset_prefix_cache_forgets_unreferenced_only():
    pm = PageManager(4, 4)
    a, b, c = pm.allocate(3)
    for page, i in zip((a, b, c), range(3)):
        pm.register(page, h(i))
    pm.release([a, b])  # c stays referenced
    pm.reset_prefix_cache()
    assert pm.match_prefix([h(0)]) == []
    assert pm.match_prefix([h(1)]) == []
    assert pm.match_prefix([h(2)]) == [c]
    assert pm.num_cached_pages == 1
    assert pm.num_free_pages == 3
    assert pm.num_referenced_pages == 1
    assert not pm._evictable
    check_invariants(pm)
    # The formerly cached pages are plain free pages now: releasing them again is an error.
    with pytest.raises(RuntimeError):
        pm.release([a])
    pm.release([c])
    assert pm.num_referenced_pages == 0
    assert pm.num_free_pages == 4
    check_invariants(pm)


def test_record_lookup_accumulates():
    pm = PageManager(4, 4)
    pm.record_lookup(10, 4)
    pm.record_lookup(6, 0)
    assert pm.prefix_queries_tokens == 16
    assert pm.prefix_hit_tokens == 4


def test_random_workload_keeps_invariants():
    import random

    rng = random.Random(0)
    pm = PageManager(16, 4)
    held: list[int] = []
    next_hash = 0
    for _ in range(2000):
        op = rng.random()
        if op < 0.35 and pm.can_allocate(2):
            pages = pm.allocate(2)
            held += pages
            for p in pages:
                if rng.random() < 0.5:
                    pm.register(p, h(next_hash))
                    next_hash += 1
        elif op < 0.6 and held:
            p = held.pop(rng.randrange(len(held)))
            pm.release([p])
        elif op < 0.8 and next_hash:
            hits = pm.match_prefix([h(rng.randrange(next_hash))])
            before = pm.num_free_pages
            evictable = pm.num_evictable_among(hits)
            pm.acquire(hits)
            assert pm.num_free_pages == before - evictable
            held += hits
        elif op < 0.82:
            pm.reset_prefix_cache()
        check_invariants(pm)
    pm.release(held)
    assert pm.num_referenced_pages == 0
    assert pm.num_free_pages == pm.num_pages
    check_invariants(pm)


# -- hashing ----------------------------------------------------------------------------------
TOKENS = list(range(100, 137))  # 37 tokens: 4 full pages of 8 and a partial one


def test_hash_full_pages_deterministic_and_count():
    a = hash_full_pages(TOKENS, 8)
    b = hash_full_pages(list(TOKENS), 8)
    assert a == b
    assert len(a) == 4  # the partial last page (5 tokens) is not hashed
    assert all(isinstance(x, bytes) and len(x) == 32 for x in a)
    assert len(set(a)) == 4
    assert hash_full_pages(TOKENS[:7], 8) == []
    assert hash_full_pages([], 8) == []


def test_partial_page_does_not_change_full_page_hashes():
    assert hash_full_pages(TOKENS[:32], 8) == hash_full_pages(TOKENS[:32] + [1, 2, 3], 8)
    assert hash_full_pages(TOKENS[:33], 8) == hash_full_pages(TOKENS[:32] + [999], 8)


def test_hash_chain_early_change_changes_all_later():
    base = hash_full_pages(TOKENS, 8)
    changed = list(TOKENS)
    changed[3] += 1  # in page 0
    other = hash_full_pages(changed, 8)
    assert all(x != y for x, y in zip(base, other))

    changed = list(TOKENS)
    changed[20] += 1  # in page 2
    other = hash_full_pages(changed, 8)
    assert other[:2] == base[:2]
    assert all(x != y for x, y in zip(base[2:], other[2:]))


def test_hash_depends_on_position_not_just_page_content():
    # Same page content at a different place in the chain has a different hash.
    tokens = [5] * 16
    first, second = hash_full_pages(tokens, 8)
    assert first != second


def test_hash_depends_on_page_size():
    assert hash_full_pages(TOKENS[:16], 8)[1] != hash_full_pages(TOKENS[:16], 16)[0]


def test_hash_chain_matches_manual_hash_page():
    expected, parent = [], ROOT_HASH
    for i in range(4):
        parent = hash_page(parent, TOKENS[i * 8 : (i + 1) * 8])
        expected.append(parent)
    assert hash_full_pages(TOKENS, 8) == expected


@pytest.mark.parametrize("start", [0, 1, 2, 3, 4])
def test_hash_continuation_equals_full(start):
    full = hash_full_pages(TOKENS, 8)
    parent = full[start - 1] if start else ROOT_HASH
    assert hash_full_pages(TOKENS, 8, start_page=start, parent=parent) == full[start:]


def test_hash_identical_in_separate_process():
    # Load block_hash.py by path (skips importing torch via engine/__init__) under a different
    # PYTHONHASHSEED: the digests must not depend on Python's salted hash().
    code = (
        "import importlib.util, sys;"
        f"spec = importlib.util.spec_from_file_location('pc', {str(REPO / 'proto' / 'block_hash.py')!r});"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m);"
        f"print(','.join(x.hex() for x in m.hash_full_pages({TOKENS!r}, 8)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"},
    ).stdout.strip()
    expected = [x.hex() for x in hash_full_pages(TOKENS, 8)]
    assert len(expected) == 4
    assert out.split(",") == expected
