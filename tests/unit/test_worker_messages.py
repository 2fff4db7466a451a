"""proto/worker_messages.py: messages survive msgpack unchanged, and bytes that are not a well-formed
message raise ValueError (what the serving loop drops with a warning) instead of escaping as
another exception and ending a worker's loop."""

from __future__ import annotations

import msgpack
import pytest

from proto import worker_messages as wm

SAMPLING = wm.Sampling(max_tokens=8, temperature=0.5, stop_token_ids=(2, 3), ignore_eos=True)


@pytest.mark.parametrize("message", [
    wm.ReserveKV("r", (1, 2, 3), 5.0, SAMPLING),
    wm.Prefill("r", (1, 2), SAMPLING, wm.KVDestination("127.0.0.1:1", 2, 0, 3.0)),
    wm.Tokens("r", "d0", (4, 5), (), True, "length", 16),
    wm.Load("d0", "decode", 0, 10, 1, "abc"),
])
def test_messages_round_trip(message):
    assert wm.decode(wm.encode(message)) == message


def packed(**raw) -> bytes:
    return msgpack.packb(raw, use_bin_type=True)


@pytest.mark.parametrize(("data", "reason"), [
    (b"\xc1", "not msgpack"),
    (packed(type="Nope"), "not a worker message"),
    (packed(type="Abort"), "fields"),
    (packed(type="ReserveKV", request_id="r", prompt_token_ids=[1], lease_s=1.0, sampling=5), "malformed ReserveKV"),
    (packed(type="ReserveKV", request_id="r", prompt_token_ids=[1], lease_s=1.0, sampling={"bogus": 1}),
     "malformed ReserveKV"),
])
def test_malformed_messages_raise_value_error(data, reason):
    with pytest.raises(ValueError, match=reason):
        wm.decode(data)
