"""engine/kv_transfer/destinations.py: a prefill worker's set of decode endpoints is replaced as a
whole (a decode worker that left is refused afterwards), starts empty (nothing is accepted before
the cluster says), and its refusal names the address, bounded."""

from __future__ import annotations

from engine.kv_transfer.destinations import KVDestinations


def test_only_the_current_set_is_allowed():
    destinations = KVDestinations()
    assert not destinations.allows("127.0.0.1:23000")  # before the cluster said anything
    destinations.replace(["127.0.0.1:23000", "127.0.0.1:23001"])
    assert destinations.allows("127.0.0.1:23001")
    assert not destinations.allows("127.0.0.1:23002") and not destinations.allows("127.0.0.1:23000 ")
    destinations.replace(["127.0.0.1:23001"])  # decode-0 left
    assert not destinations.allows("127.0.0.1:23000")
    assert destinations.addresses == frozenset({"127.0.0.1:23001"})


def test_the_refusal_names_the_address_within_bounds():
    destinations = KVDestinations(["dist:2"])
    assert destinations.refusal("dist:9") == ("KV destination 'dist:9' is not a known decode endpoint of this "
                                              "cluster (1 known)")
    long = destinations.refusal("h" * 4096)  # a peer's string: never echoed whole
    assert len(long) < 200 and "hhh..." in long
