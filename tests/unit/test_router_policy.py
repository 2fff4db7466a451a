"""Pair selection: least-loaded prefill and decode, prefix affinity with a load cap."""

from __future__ import annotations

import pytest

from router.policy import LeastLoadedPolicy, PrefixAffinityPolicy, WorkerLoad, make_policy

PROMPT = list(range(100))


def test_least_loaded_picks_fewest_queued_tokens_and_most_free_pages():
    policy = LeastLoadedPolicy()
    prefill = [WorkerLoad("p0", queued_tokens=900), WorkerLoad("p1", queued_tokens=10),
               WorkerLoad("p2", queued_tokens=0, healthy=False)]
    decode = [WorkerLoad("d0", free_pages=5), WorkerLoad("d1", free_pages=500), WorkerLoad("d2", free_pages=9999, healthy=False)]
    assert policy.choose_prefill(PROMPT, prefill) == "p1"
    assert policy.choose_decode(PROMPT, decode) == "d1"
    assert policy.choose_prefill(PROMPT, [WorkerLoad("p0", healthy=False)]) is None
    assert policy.choose_decode(PROMPT, []) is None


def test_ties_break_by_id_for_determinism():
    assert LeastLoadedPolicy().choose_prefill(PROMPT, [WorkerLoad("p1"), WorkerLoad("p0")]) == "p0"


def test_prefix_affinity_follows_the_cached_prefix_within_the_load_cap():
    policy = PrefixAffinityPolicy(block_size=16, max_extra_tokens=1000)
    policy.record(PROMPT, "p1")
    loads = [WorkerLoad("p0", queued_tokens=0), WorkerLoad("p1", queued_tokens=800)]
    assert policy.choose_prefill(PROMPT[:64] + [7, 7, 7], loads) == "p1"  # shares 4 blocks
    assert policy.choose_prefill([5] * 64, loads) == "p0"  # shares nothing: least loaded
    busy = [WorkerLoad("p0", queued_tokens=0), WorkerLoad("p1", queued_tokens=5000)]
    assert policy.choose_prefill(PROMPT, busy) == "p0"  # affinity yields to a big imbalance
    assert policy.choose_prefill(PROMPT, [WorkerLoad("p0"), WorkerLoad("p1", healthy=False)]) == "p0"


def test_longest_prefix_wins_and_memory_is_bounded():
    policy = PrefixAffinityPolicy(block_size=4, capacity=8)
    policy.record(PROMPT[:8], "p0")
    policy.record(PROMPT[:16], "p1")
    assert policy.choose_prefill(PROMPT[:16], [WorkerLoad("p0"), WorkerLoad("p1")]) == "p1"
    for i in range(10):
        policy.record([1000 + i] * 4, "p0")
    assert len(policy._owner) == 8


def test_make_policy_rejects_unknown_names():
    assert isinstance(make_policy("prefix_affinity"), PrefixAffinityPolicy)
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        make_policy("random")
