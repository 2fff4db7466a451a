"""One request id follows a request through the router, the prefill worker and the decode
worker in JSON log lines (an in-process disaggregated cluster; the lines are captured from the
one logging handler every component writes through)."""

from __future__ import annotations

import io
import json
import logging

import grpc
import pytest

from configs import EngineConfig, LoggingConfig, setup_logging
from proto import pdserve_pb2 as pb
from tests.local_cluster import LocalCluster

pytestmark = pytest.mark.cluster

ENGINE = EngineConfig(model="builtin:tiny", page_size=8, max_num_batched_tokens=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def cluster(tiny_dir):
    c = LocalCluster(tiny_dir, "disaggregated", ENGINE)
    yield c
    c.close()


@pytest.fixture
def json_log():
    root = logging.getLogger()
    level = root.level
    stream = io.StringIO()
    handler = setup_logging(LoggingConfig(format="json"), component="test", stream=stream)
    yield stream
    root.removeHandler(handler)
    root.setLevel(level)


def test_one_request_id_across_router_prefill_and_decode(cluster, json_log):
    req = pb.GenerateRequest(request_id="req-trace-1", token_ids=pb.TokenIds(ids=list(range(10, 40))),
                             sampling=pb.SamplingParams(max_tokens=5, ignore_eos=True))
    assert list(cluster.stub.Generate(req, timeout=60))[-1].finish_reason == pb.FINISH_REASON_LENGTH
    cluster.wait_pages_free()
    lines = [json.loads(line) for line in json_log.getvalue().splitlines()]
    mine = [rec for rec in lines if rec["request_id"] == "req-trace-1"]
    events = {(rec["component"], rec["event"]) for rec in mine}
    assert events >= {
        ("router", "received"), ("router", "admitted"), ("router", "dispatched"), ("router", "first_token"),
        ("router", "finished"),
        ("prefill", "admitted"), ("prefill", "prefill_done"), ("prefill", "transfer_done"),
        ("decode", "reserved"), ("decode", "transfer_received"), ("decode", "joined"), ("decode", "finished"),
    }, sorted(events)
    assert {rec["worker_id"] for rec in mine if rec["component"] == "prefill"} == {"prefill-0"}
    assert {rec["worker_id"] for rec in mine if rec["component"] == "decode"} == {"decode-0"}
    finished = next(rec for rec in mine if rec["event"] == "finished" and rec["component"] == "router")
    assert finished["fields"]["completion_tokens"] == 5 and finished["fields"]["finish_reason"] == "length"
    transfer = next(rec for rec in mine if rec["event"] == "transfer_done")
    assert transfer["fields"] == {"state": "done", "pages_sent": 4}
    # Lifecycle only: a handful of lines per component, never one per token.
    assert len(mine) < 20
    ts = [rec["ts"] for rec in mine if rec["component"] == "router"]
    assert ts == sorted(ts)


def test_rejected_request_logs_an_error_with_its_id(cluster, json_log):
    req = pb.GenerateRequest(request_id="req-bad", token_ids=pb.TokenIds(ids=[]),
                             sampling=pb.SamplingParams(max_tokens=5))
    with pytest.raises(grpc.RpcError):
        list(cluster.stub.Generate(req, timeout=60))
    errors = [json.loads(line) for line in json_log.getvalue().splitlines() if '"req-bad"' in line]
    assert [(e["event"], e["level"], e["fields"]["status"]) for e in errors if e["event"] == "error"] == [
        ("error", "WARNING", "INVALID_ARGUMENT")]
