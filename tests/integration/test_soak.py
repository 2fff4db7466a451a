"""The soak of benchmarks/soak.py, one minute long (issue 40 item 5): a real 1P2D cluster on Ray
(cluster/lifecycle.py's Cluster) under mixed streaming load, a worker SIGKILLed every 15-25 s
and replaced by the supervisor, clients cancelling and running out of deadlines throughout. At
the end no KV page is referenced and no request id is held anywhere, no stream hung, nothing
failed, and every finished greedy stream is Hugging Face's greedy output token for token."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import soak

pytestmark = [pytest.mark.ray, pytest.mark.cluster]


@pytest.mark.slow
def test_a_minute_of_mixed_load_with_workers_killed_leaves_nothing_leaked_hung_or_wrong(tmp_path):
    settings = soak.SoakSettings(duration_s=60.0, kill_every_s=(15.0, 25.0), rate=3.0, seed=0, quiet_end_s=12.0)
    report = soak.run_soak(settings, tmp_path, say=print)
    print(report.table())
    assert report.failures() == []
    # The run did what it is for: a prefill and a decode worker killed (seed 0), each replaced,
    # and every way a stream can end happened.
    assert {k["role"] for k in report.kills} == {"prefill", "decode"}, report.kills
    assert all(k["replaced_s"] is not None for k in report.kills), report.kills
    for outcome in ("finished", "cancelled", "deadline"):
        assert report.count(outcome) >= 5, (outcome, report.table())
    finished = [r for r in report.results if r.outcome == "finished"]
    assert sum(not r.plan.sampled for r in finished) >= 50 and any(r.plan.sampled for r in finished)
    # Streams cut short mid-decode too (not only before their first token).
    assert any(0 < len(r.tokens) < r.plan.max_tokens for r in report.results if r.outcome == "cancelled")
