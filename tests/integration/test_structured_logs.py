"""One request id follows a request through the router, the prefill worker and the decode
worker in JSON log lines (an in-process disaggregated cluster; the lines are captured from the
one logging handler every component writes through). That id is the router's internal one
(router/request_ids.py); the router's lines carry the client's id beside it, the workers' never."""

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
    responses = list(cluster.stub.Generate(req, timeout=60))
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert {r.request_id for r in responses} == {"req-trace-1"}  # the client's id, echoed
    cluster.wait_pages_free()
    lines = [json.loads(line) for line in json_log.getvalue().splitlines()]
    # The operator's way in: the client's id on the router's arrival line names the internal id.
    [received] = [rec for rec in lines if rec["event"] == "received"
                  and rec["fields"].get("client_request_id") == "req-trace-1"]
    internal = received["request_id"]
    assert internal and "req-trace-1" not in internal
    mine = [rec for rec in lines if rec["request_id"] == internal]
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
    assert all(rec["fields"]["client_request_id"] == "req-trace-1" for rec in mine if rec["component"] == "router")
    # No worker ever heard of the client's id: it is for echo and the router's logs only.
    assert not [rec for rec in lines if rec["component"] != "router" and "req-trace-1" in json.dumps(rec)]
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
    # Logged under the client's id and the internal one the router gave it at arrival.
    assert len({e["request_id"] for e in errors}) == 1 and errors[0]["request_id"] not in (None, "req-bad")
