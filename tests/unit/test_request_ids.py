"""router/request_ids.py: the router's internal ids and the live client ids."""

from __future__ import annotations

import re

import grpc
import pytest

from router.journey_state import RouterError
from router.request_ids import LiveIds, new_client_id, new_internal_id


def test_internal_ids_are_random_bounded_and_not_client_shaped():
    ids = {new_internal_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(re.fullmatch(r"[0-9a-f]{24}", i) for i in ids)
    assert new_client_id() != new_client_id()


def test_a_live_client_id_is_already_exists_until_it_ends():
    live = LiveIds()
    live.admit("c1", "i1")
    live.admit("c2", "i2")
    with pytest.raises(RouterError) as info:
        live.admit("c1", "i3")
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS and "'c1'" in str(info.value)
    live.end("c1", "i3")  # the refused one frees nothing of the live one's
    assert live.internal_id("c1") == "i1" and len(live) == 2
    live.end("c1", "i1")
    assert live.internal_id("c1") is None
    live.admit("c1", "i4")  # free again
    assert live.internal_id("c1") == "i4" and live.internal_id("c2") == "i2"
