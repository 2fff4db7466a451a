"""benchmarks/soak.py's verdict: each invariant it names fails the run when broken (a leaked page,
an id left, a hung stream, a greedy stream off Hugging Face's tokens, an error status, a killed
worker never replaced), and its seeded plan mixes every kind of request."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import soak
from soak_load import PlannedRequest, StreamResult

REF = [5, 6, 7, 8]


def stream(outcome: str, tokens: list[int], sampled: bool = False, status: str = "") -> StreamResult:
    plan = PlannedRequest(0, 0.0, [0, 9, 9], 4, REF, sampled, 1, None, None, None, None)
    return StreamResult(plan, outcome, status, tokens, [0.1 * i for i in range(len(tokens))])


def report(results: list[StreamResult], **changes) -> soak.SoakReport:
    fields = {"pages_referenced": {"prefill-0": 0, "decode-0": 0}, "ids_left": {"decode-0": [], "router": []},
              "router_counts": {"in_flight": 0}, "kills": [{"worker_id": "decode-0", "role": "decode", "replaced_s": 6.0}]}
    fields.update(changes)
    return soak.SoakReport(soak.SoakSettings(duration_s=60), results, wall_s=70.0, **fields)


CLEAN = [stream("finished", REF), stream("finished", [1, 2, 3, 4], sampled=True), stream("cancelled", REF[:2]),
         stream("deadline", [], status="DEADLINE_EXCEEDED")]


def test_a_clean_run_passes_and_its_table_counts_each_outcome():
    r = report(CLEAN)
    assert r.failures() == []
    table = r.table()
    assert "| requests sent | 4 |" in table and "| cancelled by the client | 1 |" in table
    assert "| finished greedy not HF-identical | 0 of 1 |" in table


@pytest.mark.parametrize(("broken", "says"), [
    ({"pages_referenced": {"decode-0": 3}}, "3 KV pages still referenced"),
    ({"ids_left": {"router": ["r-1"]}}, "request ids or counts left"),
    ({"router_counts": {"in_flight": 1}}, "request ids or counts left"),
    ({"kills": [{"worker_id": "prefill-0", "role": "prefill", "replaced_s": None}]}, "not replaced: ['prefill-0']"),
])
def test_a_leak_or_a_missing_replacement_fails(broken, says):
    (failure,) = report(CLEAN, **broken).failures()
    assert says in failure


@pytest.mark.parametrize(("bad", "says"), [
    (stream("hung", []), "1 hung streams"),
    (stream("finished", [5, 6, 7, 9]), "1 finished greedy streams differ from HF, 0 cut-short"),
    (stream("cancelled", [5, 9]), "0 finished greedy streams differ from HF, 1 cut-short"),
    (stream("finished", [1, 2], sampled=True), "wrong token count"),
    (stream("failed", [], status="UNAVAILABLE"), "failed streams: {'UNAVAILABLE': 1}"),
])
def test_a_bad_stream_fails(bad, says):
    (failure,) = report([*CLEAN, bad]).failures()
    assert says in failure


def test_failed_streams_pass_only_when_allowed():
    failed = [*CLEAN, stream("failed", [], status="UNAVAILABLE")]
    assert soak.SoakReport(soak.SoakSettings(allow_failed=True), failed, [], {}, {}, {}, 1.0).failures() == []


def test_the_plan_is_seeded_and_mixes_every_kind_of_request():
    prompts = soak.prompt_pool(0)
    refs = [list(range(max(soak.MAX_TOKENS)))] * len(prompts)
    settings = soak.SoakSettings(duration_s=120, rate=5)
    plan = soak.plan_requests(settings, prompts, refs)
    assert plan == soak.plan_requests(settings, prompts, refs)
    assert 400 < len(plan) < 800 and all(0 <= p.at_s < 120 for p in plan)
    assert {len(p.prompt) for p in plan} == set(soak.PROMPT_LENGTHS)
    assert all(p.reference == refs[0][: p.max_tokens] for p in plan)
    kinds = {"sampled": sum(p.sampled for p in plan), "cancel at": sum(p.cancel_at_s is not None for p in plan),
             "cancel after": sum(p.cancel_after_tokens is not None for p in plan),
             "grpc deadline": sum(p.grpc_deadline_s is not None for p in plan),
             "timeout_s": sum(p.timeout_s is not None for p in plan)}
    assert all(n >= 20 for n in kinds.values()), kinds
    assert all(0 < p.cancel_after_tokens < p.max_tokens for p in plan if p.cancel_after_tokens is not None)
