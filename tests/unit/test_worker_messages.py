"""proto/worker_messages.py: messages survive msgpack unchanged, and bytes that are not a well-formed
message raise ValueError (what the serving loop drops with a warning) instead of escaping as
another exception and ending a worker's loop."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from proto import worker_messages as wm

SAMPLING = wm.Sampling(max_tokens=8, temperature=0.5, stop_token_ids=(2, 3), ignore_eos=True)


@pytest.mark.parametrize("message", [
    wm.ReserveKV("r", (1, 2, 3), 5.0, SAMPLING),
    wm.Prefill("r", (1, 2), SAMPLING, wm.KVDestination("127.0.0.1:1", 2, 0, 3.0)),
    wm.Tokens("r", "d0", (4, 5), (), True, "length", 16),
    wm.Tokens("r", "d0", (4, 5, 6), (), False, None, 0, 7, 5),  # an accepted speculative run, with the totals
    wm.Generate("r", (1,), dataclasses.replace(SAMPLING, speculative_method="prompt_lookup", num_speculative_tokens=3)),
    wm.Load("d0", "decode", 0, 10, 1, "abc"),
    wm.Load("p0", "prefill", 5, 10, 1, "abc", (wm.KVLink("dist:2", False, "peer gone"),
                                               wm.KVLink("127.0.0.1:9", True, "", 2.5e9, 1e-4)), 4000.0, 0.02, 6144),
    wm.KVBlocks("d0", "abc", 3, (1, 2**63 - 1), (7,), lost=True),
    wm.SetRole("prefill-0", "decode", "TPOT p90 0.2 s over 0.15 s"),
    # Every seed the public API takes (uint64) and the engine takes (down to -2**63) crosses.
    *(wm.Generate("r", (1,), dataclasses.replace(SAMPLING, seed=seed)) for seed in (2**64 - 1, 2**63, -(2**63))),
])
def test_messages_round_trip(message):
    assert wm.decode(wm.encode(message)) == message


def packed(**raw) -> bytes:
    return msgpack.packb(raw, use_bin_type=True)


@pytest.mark.parametrize(("data", "reason"), [
    (b"\xc1", "not msgpack"),
    (packed(type="Nope"), "not a worker message"),
    (packed(type="Abort"), "fields"),
    (packed(type="ReserveKV", request_id="r", prompt_token_ids=[1], lease_s=1.0, sampling=5), "sampling must be a map"),
    (packed(type="ReserveKV", request_id="r", prompt_token_ids=[1], lease_s=1.0, sampling={"bogus": 1}),
     r"sampling \(Sampling\): missing fields"),
    (packed(type="Abort", request_id={}), "request_id must be a string"),
    (packed(type="SetRole", worker_id="p0", role=1, reason=""), r"SetRole.role must be a string"),
    (packed(type="Abort", request_id="x" * 257), "at most 256 characters"),
    (packed(type="ReserveKV", request_id="r", prompt_token_ids=[1, "2"], lease_s=1.0, sampling={}), "must be an int"),
    (packed(type="ReserveKV", request_id="r", prompt_token_ids=[1], lease_s=float("nan"),
            sampling=dataclasses.asdict(SAMPLING)), "lease_s must be a finite number"),
    (packed(type="ReserveKV", request_id="r", prompt_token_ids=[1], lease_s=float("inf"),
            sampling=dataclasses.asdict(SAMPLING)), "lease_s must be a finite number"),
    (packed(type="Tokens", request_id="r", worker_id="d0", token_ids=[True], logprobs=[], finished=False,
            finish_reason=None, num_cached_prompt_tokens=0, spec_proposed_tokens=0, spec_accepted_tokens=0),
     "token_ids must be an int"),
    (packed(type="Tokens", request_id="r", worker_id="d0", token_ids=[1], logprobs=[], finished=1,
            finish_reason=None, num_cached_prompt_tokens=0, spec_proposed_tokens=0, spec_accepted_tokens=0),
     "finished must be a bool"),
    (packed(type="Tokens", request_id="r", worker_id="d0", token_ids=[1], logprobs=[], finished=False,
            finish_reason=None, num_cached_prompt_tokens=0, spec_proposed_tokens=True, spec_accepted_tokens=0),
     "spec_proposed_tokens must be an int"),
    (packed(type="Generate", request_id="r", prompt_token_ids=[1],
            sampling=dataclasses.asdict(SAMPLING) | {"speculative_method": 3}), "speculative_method must be a string"),
    (packed(type="Generate", request_id="r", prompt_token_ids=[1],
            sampling=dataclasses.asdict(SAMPLING) | {"num_speculative_tokens": 2.0}),
     "num_speculative_tokens must be an int"),
    (packed(type="Load", worker_id="d0", role="decode", queued_tokens=2**64 - 1, free_pages=1, running=0,
            incarnation="", kv_links=[], prefill_tokens_per_s=0.0, decode_step_s=0.0, kv_bytes_per_token=0),
     "queued_tokens must be an int"),
    (packed(type="Load", worker_id="d0", role="decode", queued_tokens=1, free_pages=1, running=0,
            incarnation="", kv_links=[{"address": "x", "up": "yes", "detail": "", "bytes_per_s": 0.0,
                                       "latency_s": 0.0}], prefill_tokens_per_s=0.0, decode_step_s=0.0,
            kv_bytes_per_token=0), "up must be a bool"),
    (packed(type="KVBlocks", worker_id="d0", incarnation="a", seq=0, stored=[1.5], removed=[], lost=False),
     "stored must be an int"),
    (packed(type="Generate", request_id="r", prompt_token_ids=[1], sampling=dataclasses.asdict(SAMPLING) | {"seed": 1.5}),
     r"seed must be an int in \[-2\*\*63, 2\*\*64\)"),  # msgpack cannot carry one outside it
    (b"\x81\x91\x01\x02", "not msgpack"),  # a map whose key is a list
])
def test_malformed_messages_raise_value_error(data, reason):
    with pytest.raises(ValueError, match=reason):
        wm.decode(data)


def test_a_bad_field_is_named_with_its_path_and_a_bad_shape_with_what_is_missing():
    sampling = {**dataclasses.asdict(SAMPLING), "max_tokens": "four"}
    with pytest.raises(ValueError, match=r"^ReserveKV\.sampling\.max_tokens must be an int"):
        wm.decode(packed(type="ReserveKV", request_id="r", prompt_token_ids=[1], lease_s=1.0, sampling=sampling))
    short = {k: v for k, v in dataclasses.asdict(SAMPLING).items() if k != "seed"}
    with pytest.raises(ValueError, match=r"^ReserveKV\.sampling \(Sampling\): missing fields \['seed'\]$"):
        wm.decode(packed(type="ReserveKV", request_id="r", prompt_token_ids=[1], lease_s=1.0, sampling=short))
    with pytest.raises(ValueError, match=r"Abort \(Abort\): unknown fields \['extra'\]"):
        wm.decode(packed(type="Abort", request_id="r", extra=1))
    assert wm.request_id_of(packed(type="ReserveKV", request_id="r-7", sampling=sampling)) == "r-7"
    assert wm.request_id_of(b"\xc1 not msgpack") is None and wm.request_id_of(packed(type="Abort", request_id={})) is None
