"""router/token_counts.py: the prefill gate's and the local queue's per-worker prompt tokens."""

from __future__ import annotations

import pytest

from router.token_counts import TokenCounts


def test_counts_add_and_release_per_worker_and_forget_a_worker_at_zero():
    c = TokenCounts("local queue")
    c.add("d0", 300)
    c.add("d0", 20)
    c.add("d1", 5)
    assert (c.tokens("d0"), c.tokens("d1"), c.tokens("d2"), c.total()) == (320, 5, 0, 325)
    c.done("d0", 320)
    assert c.workers() == {"d1"} and c.total() == 5


def test_releasing_more_than_was_added_is_a_bug_named_by_its_owner():
    c = TokenCounts("prefill gate")
    c.add("p0", 10)
    with pytest.raises(RuntimeError, match="prefill gate: p0 released 11 tokens it was not holding"):
        c.done("p0", 11)
    assert c.tokens("p0") == 10  # nothing changed by the refused release
