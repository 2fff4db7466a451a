"""Benchmark metric math on synthetic timelines with known answers."""

from __future__ import annotations

import math

import pytest

from loadgen.metrics import (
    SLO,
    RequestRecord,
    max_rate_at_attainment,
    percentile,
    summarize,
    summarize_run,
)


def test_percentiles_interpolate_like_numpy():
    values = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert percentile(values, 50) == 5.5
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    assert summarize([2.0, 4.0])["mean"] == 3.0


def test_ttft_tpot_itl_e2e_of_one_request():
    r = RequestRecord(arrival=10.0, token_times=(10.5, 10.6, 10.8, 11.1), num_tokens=4, prompt_tokens=8)
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.1)
    assert r.tpot == pytest.approx((1.1 - 0.5) / 3)
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    single = RequestRecord(0.0, (0.2,), 1, 3)
    assert single.tpot is None and single.itls == []


def test_goodput_and_attainment():
    fast = RequestRecord(0.0, (0.1, 0.15, 0.2), 3, 4)  # ttft 0.1, tpot 0.05
    slow_first = RequestRecord(0.0, (0.9, 0.95), 2, 4)  # ttft 0.9
    slow_decode = RequestRecord(0.0, (0.1, 0.6), 2, 4)  # tpot 0.5
    failed = RequestRecord(0.0, (), 0, 4, ok=False, error="UNAVAILABLE")
    s = summarize_run([fast, slow_first, slow_decode, failed], duration_s=2.0, slo=SLO(ttft_s=0.5, tpot_s=0.1))
    assert s.num_failed == 1 and s.request_throughput == 1.5
    assert s.output_token_throughput == (3 + 2 + 2) / 2.0
    assert s.goodput == 0.5 and s.attainment == 0.25
    assert s.ttft["p50"] == pytest.approx(0.1)


def test_max_rate_at_attainment_interpolates():
    assert max_rate_at_attainment([1, 2, 4, 8], [1.0, 0.95, 0.85, 0.3]) == pytest.approx(2 + 2 * (0.95 - 0.9) / 0.1)
    assert max_rate_at_attainment([1, 2], [0.99, 0.97]) == 2  # never drops below: the highest swept
    assert math.isnan(max_rate_at_attainment([1, 2], [0.5, 0.4]))
    assert max_rate_at_attainment([4, 1, 2], [0.5, 1.0, 0.9]) == pytest.approx(2.0)


def test_slo_scaling_and_no_slo():
    r = RequestRecord(0.0, (0.4, 0.5, 0.6), 3, 4)  # ttft 0.4, tpot 0.1
    slo = SLO(ttft_s=0.3, tpot_s=0.08)
    assert not slo.met_by(r) and slo.scaled(1.5).met_by(r)
    assert (slo.scaled(1.5).ttft_s, slo.scaled(1.5).tpot_s) == pytest.approx((0.45, 0.12))
    assert SLO(ttft_s=1.0).scaled(2) == SLO(ttft_s=2.0)  # an unset target stays unset
    s = summarize_run([r], 1.0, SLO())  # no targets: attainment is undefined, not 100%
    assert math.isnan(s.attainment) and math.isnan(s.goodput)
