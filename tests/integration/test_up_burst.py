"""Overload under `pdserve up` (issue 11, "nothing admitted fails"): one burst of many times what
the prefill worker takes at once, over both front doors of a real 1P1D cluster (Ray actors,
ZMQ, the router in its own actor). Every request must finish, with Hugging Face's greedy
tokens, and afterwards no worker may hold a page. The in-process twin, with the control that
shows the leases would run out without the router's prefill gate, is
tests/integration/test_grpc_serving.py::test_a_burst_queued_for_prefill_outlives_no_lease."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from router.tokenizer import RouterTokenizer
from tests.cli_helpers import pdserve, start_up, status, stop_up, wait_for, write_config
from tests.helpers import hf_greedy

pytestmark = [pytest.mark.ray, pytest.mark.cluster, pytest.mark.slow]

NUM_REQUESTS, PROMPT_TOKENS, MAX_TOKENS = 48, 1000, 6
PREFILL_BATCH_TOKENS = 512  # the prefill worker's max_num_batched_tokens: the burst is ~94 steps of it
PREFILL_QUEUE_TOKENS = 2048  # router.max_prefill_queue_tokens: the burst is 23x what may wait on prefill
# The burst takes ~4 s to prefill here (~11k tokens/s); a reservation made at arrival, waiting
# behind all of it, would run out (the test fails so with the gate opened to 10**9 tokens). The
# at most two prompts the gate lets wait on the prefill worker take ~0.2 s.
LEASE_S = 1.5


def prompt(i: int) -> list[int]:
    """Distinct prompts (no shared prefix for the prefix cache to skip), ids inside the vocabulary."""
    return [0] + [(i * 131 + j * 7) % 4000 + 50 for j in range(PROMPT_TOKENS - 1)]


def over_grpc(port: int, ids: list[int]) -> list[int]:
    import grpc

    from proto import pdserve_pb2 as pb
    from proto import pdserve_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                                 sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        return [t for r in pdserve_pb2_grpc.GenerationStub(channel).Generate(req, timeout=120) for t in r.token_ids]


def over_http(port: int, ids: list[int]) -> str:
    """OpenAI completions with a token-id prompt: the completion's text."""
    body = json.dumps({"prompt": ids, "max_tokens": MAX_TOKENS, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as reply:
        answer = json.loads(reply.read())
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == MAX_TOKENS
    return answer["choices"][0]["text"]


def test_a_burst_far_beyond_prefill_capacity_all_succeeds_under_up(tmp_path, tiny_dir, hf_tiny):
    config = write_config(tmp_path, "disaggregated", num_cpus_per_worker=0.5)
    cfg = yaml.safe_load(config.read_text())
    cfg["router"]["max_prefill_queue_tokens"] = PREFILL_QUEUE_TOKENS
    cfg["prefill"]["engine"]["max_num_batched_tokens"] = PREFILL_BATCH_TOKENS
    cfg["kv_transfer"]["reservation_lease_s"] = LEASE_S
    config.write_text(yaml.safe_dump(cfg))
    router = cfg["router"]
    up = start_up(tmp_path, config)
    try:
        def one(i: int) -> tuple[str, list[int] | str]:
            try:  # even requests over gRPC (token ids back), odd ones over HTTP (text back)
                if i % 2 == 0:
                    return "ok", over_grpc(router["grpc_port"], prompt(i))
                return "ok", over_http(router["http_port"], prompt(i))
            except Exception as exc:  # noqa: BLE001 - every failure is reported, not just the first
                return "failed", f"request {i}: {type(exc).__name__}: {exc}"

        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            outcomes = list(pool.map(one, range(NUM_REQUESTS)))
        failures = [str(got) for kind, got in outcomes if kind == "failed"]
        assert not failures, f"{len(failures)} of {NUM_REQUESTS} failed:\n" + "\n".join(failures)
        tokenizer = RouterTokenizer(tiny_dir)
        for i, (_, got) in enumerate(outcomes):
            want = hf_greedy(hf_tiny, prompt(i), MAX_TOKENS)[0]
            assert got == (want if i % 2 == 0 else tokenizer.decode(want)), f"request {i}"

        def nothing_held():
            workers = status(config, tmp_path)["workers"]
            return all(w["kv_pages"]["referenced"] == 0 and w["running"] == 0 and w["waiting"] == 0
                       for w in workers) and workers

        workers = wait_for(nothing_held, "every page free on every worker", timeout_s=30)
        assert sorted(w["worker_id"] for w in workers) == ["decode-0", "prefill-0"]
        assert all(w["rejected"] == {} for w in workers)
        down = pdserve("down", str(config), tmp_path=tmp_path)
        assert down.returncode == 0, down.stderr
        assert up.wait(timeout=60) == 0
    finally:
        stop_up(up)
