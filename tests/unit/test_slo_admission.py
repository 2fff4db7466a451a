"""SLO-aware admission (router/slo_admission.py): the bound, the refusal's status, message and
retry hint, the colocated prediction, and the HTTP door's 429 with Retry-After."""

from __future__ import annotations

import json

import grpc
import pytest

from router.journey_state import RouterError
from router.openai_http import router_error_response
from router.slo_admission import SloAdmission, SloRefused, colocated_ttft_s


def test_a_prediction_within_the_bound_or_none_is_admitted():
    gate = SloAdmission(ttft_target_s=0.5, factor=2.0)
    assert gate.bound_s == 1.0
    gate.check(None)  # nothing measured yet
    gate.check(0.99)
    gate.check(1.0)


def test_a_prediction_past_the_bound_is_refused_with_a_retry_hint():
    gate = SloAdmission(ttft_target_s=0.5, factor=2.0)
    with pytest.raises(SloRefused, match=r"predicted time to first token 3\.40 s is past 2 x the 500 ms TTFT "
                                         r"target \(router\.slo_admission_factor\); retry in 3 s") as info:
        gate.check(3.4)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and info.value.retry_after_s == 3
    with pytest.raises(SloRefused) as info:
        gate.check(1.01)
    assert info.value.retry_after_s == 1  # never sooner than a second


def test_the_colocated_prediction_is_the_unprefilled_queue_over_the_measured_rates():
    assert colocated_ttft_s(900, 100, [0.0, 0.0]) is None  # no worker has measured a rate
    assert colocated_ttft_s(900, 100, [500.0, 0.0]) == pytest.approx(2.0)
    assert colocated_ttft_s(900, 100, [500.0, 1500.0]) == pytest.approx(0.5)


def test_the_http_door_answers_429_with_retry_after_only_for_slo_refusals():
    refused = router_error_response(SloRefused("predicted ... retry in 4 s", 4))
    assert refused.status == 429 and refused.headers["Retry-After"] == "4"
    assert json.loads(refused.body)["error"]["type"] == "rate_limit_exceeded"
    full = router_error_response(RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, "300 requests in flight"))
    assert full.status == 429 and "Retry-After" not in full.headers
