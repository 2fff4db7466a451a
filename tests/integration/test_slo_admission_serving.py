"""SLO-aware admission served end to end (router/slo_admission.py), in one process: once the
workers have measured their prefill rate, a request predicted past `slo_admission_factor` x
`slo_ttft_ms` is refused at once with RESOURCE_EXHAUSTED and a retry-after trailer, counted,
and nothing of it is admitted (no request in flight, no page held, no token queued)."""

from __future__ import annotations

import time

import grpc
import pytest

from configs import EngineConfig
from proto import pdserve_pb2 as pb
from tests.helpers import hf_greedy
from tests.local_cluster import LocalCluster

pytestmark = pytest.mark.cluster

ENGINE = EngineConfig(model="builtin:tiny", page_size=8, max_num_batched_tokens=64, max_num_seqs=16)
PROMPT = [0] + list(range(100, 160))  # one 61-token prefill step: past rates.py's 32-token floor


def request(prompt: list[int]) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True))


def wait_measured(c: LocalCluster, role: str) -> None:
    deadline = time.monotonic() + 10
    while not any(w.prefill_tokens_per_s > 0 for w in c.router.pool.loads(role)):
        assert time.monotonic() < deadline, f"no {role} worker reported a prefill rate"
        time.sleep(0.05)


@pytest.mark.parametrize(("mode", "role"), [("colocated", "colocated"), ("disaggregated", "prefill")])
def test_a_request_predicted_past_the_ttft_bound_is_refused_and_nothing_is_admitted(tiny_dir, hf_tiny, mode, role):
    # A 1 microsecond target: any measured prefill rate predicts a miss; before one, no prediction.
    c = LocalCluster(tiny_dir, mode, ENGINE, slo_ttft_ms=0.001, slo_admission_factor=1.0, disaggregation="always")
    try:
        first = c.stub.GenerateUnary(request(PROMPT), timeout=60)  # nothing measured: admitted
        assert list(first.token_ids) == hf_greedy(hf_tiny, PROMPT, 4)[0]
        wait_measured(c, role)
        with pytest.raises(grpc.RpcError) as info:
            c.stub.GenerateUnary(request(PROMPT[:40]), timeout=60)
        err = info.value
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "predicted time to first token" in err.details() and "router.slo_admission_factor" in err.details()
        retry = dict(err.trailing_metadata())["retry-after"]
        assert int(retry) >= 1
        router = c.router
        assert router.metrics.slo_refused._value.get() == 1
        assert (router.in_flight.requests, router.in_flight.unprefilled_tokens, router.in_flight.prompt_tokens) == (0, 0, 0)
        text = router.metrics.exposition().decode()
        assert 'pdserve_request_errors_total{status="RESOURCE_EXHAUSTED"} 1.0' in text
        assert "pdserve_slo_refused_total 1.0" in text
        c.wait_pages_free()
    finally:
        c.close()
