"""A request's TTFT stages (router/ttft_stages.py) and their carriers (proto/usage_stages.py):
the stages sum to the TTFT exactly, a lost attempt counts as queued, the hand-off ends at the
decode worker's first token even when the prefill worker's report comes later."""

from __future__ import annotations

import pytest

from proto import pdserve_pb2 as pb
from proto.usage_stages import request_stages, usage_stages
from router.ttft_stages import KvHandoff, StageClock, TtftBreakdown


def test_the_stages_of_a_local_request_sum_to_its_ttft():
    c = StageClock(start=10.0)
    assert c.ttft_breakdown() is None and c.kv_handoff() is None  # nothing before the first token
    c.mark_sent(10.25)
    assert c.mark_first_token(11.0) == pytest.approx(1.0)
    b = c.ttft_breakdown()
    assert b == TtftBreakdown(queued_s=0.25, prefill_s=0.75)
    assert b.queued_s + b.prefill_s + b.transfer_s + b.decode_wait_s == pytest.approx(1.0, abs=1e-9)
    assert c.kv_handoff() is None  # no decode worker joined after it: not a remote placement


def test_a_retry_moves_the_sent_mark_until_a_token_reached_the_client():
    c = StageClock(start=0.0)
    c.mark_sent(0.1)  # attempt 0, lost before its first token
    c.mark_sent(2.0)  # attempt 1
    c.mark_first_token(2.5)
    c.mark_sent(3.0)  # a later attempt, after the client has tokens: TTFT is over
    assert c.ttft_breakdown() == TtftBreakdown(queued_s=2.0, prefill_s=0.5)
    assert c.mark_first_token(9.0) == pytest.approx(2.5)  # measured once


def test_the_hand_off_splits_first_token_to_decode_token():
    c = StageClock(start=0.0)
    c.mark_kv_sent(0.2)  # before the first token: not this request's hand-off yet, ignored
    c.mark_sent(0.0)
    c.mark_first_token(1.0)
    c.mark_kv_sent(1.3)
    c.mark_decode_first(1.5)
    assert c.kv_handoff() == KvHandoff(transfer_s=pytest.approx(0.3), decode_wait_s=pytest.approx(0.2))


def test_a_decode_token_heard_before_the_transfer_report_ends_the_transfer():
    c = StageClock(start=0.0)
    c.mark_sent(0.0)
    c.mark_first_token(1.0)
    c.mark_decode_first(1.2)
    c.mark_kv_sent(1.4)  # its socket was slower than the decode worker's
    h = c.kv_handoff()
    assert h.transfer_s == pytest.approx(0.2) and h.decode_wait_s == 0.0


def test_usage_stages_flatten_to_the_stage_names_bench_and_metrics_use():
    usage = pb.Usage(ttft_s=1.0, ttft_breakdown=pb.TtftBreakdown(queued_s=0.25, prefill_s=0.75),
                     kv_handoff=pb.KvHandoff(transfer_s=0.1, decode_wait_s=0.0))
    nested = usage_stages(usage)
    assert nested["ttft_breakdown"] == {"queued_s": 0.25, "prefill_s": 0.75, "transfer_s": 0.0, "decode_wait_s": 0.0}
    assert request_stages(nested) == {"queued": 0.25, "prefill": 0.75, "transfer": 0.1, "decode_wait": 0.0}
    assert request_stages(usage_stages(pb.Usage(ttft_s=1.0))) == {}  # another server, or no token
