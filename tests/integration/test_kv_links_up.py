"""KV links that survive, under `pdserve up` (embedded Ray, real actors, a real gloo group): a
torch_dist cluster with a shortened group timeout serves after idling three times that long,
and a link that dies anyway (its prefill worker stalled past the group timeout) is reported by
`pdserve status` and the router's `pdserve_kv_link_up`, and its pair's KV goes over ZMQ, every
greedy output still Hugging Face's."""

from __future__ import annotations

import os
import signal
import time
import urllib.request

import grpc
import pytest
import yaml

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc
from tests.cli_helpers import pdserve, start_up, status, stop_up, wait_for, write_config
from tests.helpers import hf_greedy

pytestmark = [pytest.mark.ray, pytest.mark.cluster, pytest.mark.slow]
GROUP_TIMEOUT_S = 3.0


def served_matches_hf(port: int, hf_model, salt: int) -> None:
    prompts = [[0] + list(range(100 + salt, 140 + salt)), [0, 7, salt + 3]]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        for p in prompts:
            reply = stub.GenerateUnary(pb.GenerateRequest(token_ids=pb.TokenIds(ids=p),
                                                          sampling=pb.SamplingParams(max_tokens=8, ignore_eos=True)),
                                       timeout=60)
            assert list(reply.token_ids) == hf_greedy(hf_model, p, 8)[0]


def test_torch_dist_links_outlive_idleness_and_a_dead_link_falls_back_to_zmq(tmp_path, hf_tiny):
    config = write_config(tmp_path, "disaggregated", "torch_dist")
    cfg = yaml.safe_load(config.read_text())
    cfg["kv_transfer"].update(dist_timeout_s=GROUP_TIMEOUT_S, link_heartbeat_s=GROUP_TIMEOUT_S / 3)
    config.write_text(yaml.safe_dump(cfg))
    port, http = cfg["router"]["grpc_port"], cfg["router"]["http_port"]
    up = start_up(tmp_path, config)
    try:
        served_matches_hf(port, hf_tiny, 0)
        time.sleep(3 * GROUP_TIMEOUT_S + 1)  # before heartbeats, every link was dead after one timeout
        served_matches_hf(port, hf_tiny, 1)
        workers = {w["worker_id"]: w for w in status(config, tmp_path)["workers"]}
        assert workers["prefill-0"]["kv_links"]["decode-0"]["up"], workers["prefill-0"]

        # A stall past the group timeout ends the decode worker's posted receive: the link is dead.
        pid = workers["prefill-0"]["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(GROUP_TIMEOUT_S + 2)
        finally:
            os.kill(pid, signal.SIGCONT)

        def fell_back():
            link = {w["worker_id"]: w for w in status(config, tmp_path)["workers"]}["prefill-0"]["kv_links"]["decode-0"]
            return link if not link["up"] and link["fallback"] else None

        link = wait_for(fell_back, "the dead link reported with its ZMQ fallback", 30)
        assert "hears" in link["error"] or "send" in link["error"], link
        wait_for(lambda: all(w.get("healthy") for w in status(config, tmp_path)["workers"]), "healthy workers", 30)
        served_matches_hf(port, hf_tiny, 2)  # over ZMQ now
        text = urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=10).read().decode()
        assert 'pdserve_kv_link_up{dst="decode-0",src="prefill-0"} 0.0' in text
        shown = pdserve("status", str(config), tmp_path=tmp_path)
        assert "prefill-0 -> decode-0: DOWN (" in shown.stdout and "KV goes over the fallback" in shown.stdout
    finally:
        stop_up(up)
