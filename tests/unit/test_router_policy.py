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
    """`cached`: per worker, the prompt tokens its prefix cache holds (the KV block index)."""
    policy = PrefixAffinityPolicy(max_extra_tokens=1000, max_extra_requests=2)
    loads = [WorkerLoad("p0", queued_tokens=0), WorkerLoad("p1", queued_tokens=800)]
    assert policy.choose_prefill(PROMPT, loads, {"p0": 0, "p1": 64}) == "p1"
    assert policy.choose_prefill(PROMPT, loads, {"p0": 0, "p1": 0}) == "p0"  # nothing cached: least loaded
    assert policy.choose_prefill(PROMPT, loads) == "p0"
    busy = [WorkerLoad("p0", queued_tokens=0), WorkerLoad("p1", queued_tokens=5000)]
    assert policy.choose_prefill(PROMPT, busy, {"p1": 96}) == "p0"  # affinity yields to a big imbalance
    assert policy.choose_prefill(PROMPT, [WorkerLoad("p0"), WorkerLoad("p1", healthy=False)], {"p1": 96}) == "p0"


def test_decode_affinity_takes_the_longest_cached_prefix_within_its_request_cap():
    policy = PrefixAffinityPolicy(max_extra_requests=2)
    loads = [WorkerLoad("d0", in_flight=0, free_pages=100), WorkerLoad("d1", in_flight=2, free_pages=100),
             WorkerLoad("d2", in_flight=1, free_pages=100)]
    assert policy.choose_decode(PROMPT, loads, {"d1": 32, "d2": 16}) == "d1"  # longest prefix, within 2 of d0
    assert policy.choose_decode(PROMPT, loads, {"d1": 32, "d2": 32}) == "d2"  # a tie goes to the less busy
    assert policy.choose_decode(PROMPT, loads, {}) == "d0"
    loads[1] = WorkerLoad("d1", in_flight=3, free_pages=100)
    assert policy.choose_decode(PROMPT, loads, {"d1": 64}) == "d0"  # 3 more in flight: over the cap


def test_make_policy_rejects_unknown_names():
    assert isinstance(make_policy("prefix_affinity"), PrefixAffinityPolicy)
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        make_policy("random")
