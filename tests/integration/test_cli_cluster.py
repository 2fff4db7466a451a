"""The user's path: `pdserve up CONFIG` (embedded Ray, real actors), `pdserve generate`, and
`pdserve down`, as subprocesses. The reply must be the engine's greedy output, every /metrics
target `up` lists must answer, and after `down` the `up` process and its Ray cluster must be
gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.cli_helpers import REPO, env, pdserve, start_up, status, stop_up, wait_for, write_config
from tests.helpers import hf_greedy
from tests.local_cluster import free_port

pytestmark = [pytest.mark.ray, pytest.mark.cluster]


def concurrent_mix_matches_hf(port: int, hf_model) -> None:
    import grpc

    from proto import pdserve_pb2 as pb
    from proto import pdserve_pb2_grpc

    base = [0] + list(range(500, 560))
    prompts = [base, base[:33] + [7, 7], [0, 9], list(range(3, 40))]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        futures = [stub.GenerateUnary.future(pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=p), sampling=pb.SamplingParams(max_tokens=10, ignore_eos=True)), timeout=120)
            for p in prompts]
        for p, f in zip(prompts, futures):
            assert list(f.result().token_ids) == hf_greedy(hf_model, p, 10)[0]


def scrape_every_target(tmp_path: Path, mode: str) -> None:
    """The Prometheus file_sd list `up` wrote names the router and each worker; each answers."""
    (targets_file,) = (tmp_path / "run").glob("*.prometheus.json")
    targets = json.loads(targets_file.read_text())
    roles = ["prefill", "decode"] if mode == "disaggregated" else ["colocated"]
    assert sorted(t["labels"]["component"] for t in targets) == sorted(["router", *roles])
    for t in targets:
        text = urllib.request.urlopen(f"http://{t['targets'][0]}/metrics", timeout=10).read().decode()
        if t["labels"]["component"] == "router":
            assert "pdserve_goodput_requests_total" in text
        else:
            assert f'pdserve_worker_kv_pages_used{{role="{t["labels"]["component"]}",worker_id=' in text
            assert "pdserve_worker_decode_tokens_total" in text


def flight_dumps_replay(config, tmp_path, mode: str, replay: bool) -> None:
    """`pdserve debug dump` writes the router's and every worker's flight recorder; `pdserve replay`
    re-drives the workers' into twins that end every request as recorded; SIGUSR1 dumps a worker."""
    dumped = pdserve("debug", "dump", str(config), "--out", str(tmp_path / "flight"), tmp_path=tmp_path)
    assert dumped.returncode == 0, dumped.stderr
    workers = ["colocated-0"] if mode == "colocated" else ["decode-0", "prefill-0"]
    assert sorted(p.name for p in (tmp_path / "flight").iterdir()) == sorted(
        f"{name}.flight.jsonl" for name in ["router", *workers])
    if replay:
        replayed = pdserve("replay", str(tmp_path / "flight"), tmp_path=tmp_path)
        assert replayed.returncode == 0, replayed.stdout + replayed.stderr
        assert " same" in replayed.stdout and "DIFFERENT" not in replayed.stdout
    pid = next(w["pid"] for w in status(config, tmp_path)["workers"] if w["worker_id"] == workers[0])
    os.kill(pid, signal.SIGUSR1)  # a worker process this test's cluster started
    wait_for(lambda: list((tmp_path / "flight-signals").glob(f"{workers[0]}-{pid}-*SIGUSR1.flight.jsonl")),
             "the SIGUSR1 dump", timeout_s=20)


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "transport"),
                         [("disaggregated", "zmq"), ("disaggregated", "torch_dist"), ("colocated", "zmq")])
def test_up_generate_down(tmp_path, mode, transport, hf_tiny):
    config = write_config(tmp_path, mode, transport)
    up = start_up(tmp_path, config)
    try:
        reply = pdserve("generate", "def fibonacci(n):", "--config", str(config), "--max-tokens", "16",
                        "--ignore-eos", tmp_path=tmp_path)
        assert reply.returncode == 0, reply.stderr
        offline = pdserve("complete", "def fibonacci(n):", "--max-tokens", "16", "--ignore-eos", tmp_path=tmp_path)
        assert reply.stdout.strip() == offline.stdout[len("def fibonacci(n):"):].strip()
        assert "16 tokens, finish=FINISH_REASON_LENGTH" in reply.stderr
        concurrent_mix_matches_hf(yaml.safe_load(config.read_text())["router"]["grpc_port"], hf_tiny)
        scrape_every_target(tmp_path, mode)
        flight_dumps_replay(config, tmp_path, mode, replay=transport == "zmq")
        twice = subprocess.run([sys.executable, "-m", "cluster.cli", "up", str(config)], capture_output=True,
                               text=True, timeout=60, env=env(tmp_path), cwd=REPO)
        assert twice.returncode != 0 and "already up" in twice.stderr
        down = pdserve("down", str(config), tmp_path=tmp_path)
        assert down.returncode == 0, down.stderr
        assert up.wait(timeout=60) == 0
        assert "pdserve: stopped" in (tmp_path / "up.log").read_text()
        assert not list((tmp_path / "run").glob("*.prometheus.json"))
    finally:
        stop_up(up)
    again = pdserve("down", str(config), tmp_path=tmp_path)
    assert again.returncode == 1 and "no running cluster" in again.stderr


@pytest.mark.slow
def test_sharded_pools_prefill_tp2_to_decode_pp2(tmp_path, hf_tiny):
    """TP=2 prefill ships whole pages regrouped for a PP=2 decode worker: each worker is a
    placement group of two Ray actors (driver + follower) joined by gloo."""
    config = write_config(tmp_path, "disaggregated", engines={"prefill": {"tensor_parallel_size": 2},
                                                               "decode": {"pipeline_parallel_size": 2}},
                          num_cpus_per_worker=0.25)
    up = start_up(tmp_path, config)
    try:
        concurrent_mix_matches_hf(yaml.safe_load(config.read_text())["router"]["grpc_port"], hf_tiny)
        down = pdserve("down", str(config), tmp_path=tmp_path)
        assert down.returncode == 0, down.stderr
        assert up.wait(timeout=60) == 0
    finally:
        stop_up(up)


@pytest.mark.slow
def test_status_scale_and_replacement(tmp_path, hf_tiny):
    """`pdserve scale` adds a decode worker that takes traffic and drains it away again without
    failing the request it serves; `pdserve role` flips it to prefill and back, serving as it
    goes (the workers are switchable: router.role_switching.mode manual); a decode worker whose
    process is killed is replaced at its index while the request it held is resumed elsewhere;
    `pdserve status` shows it all."""
    import grpc

    from proto import pdserve_pb2 as pb
    from proto import pdserve_pb2_grpc

    config = write_config(tmp_path, "disaggregated", num_cpus_per_worker=0.25)
    cfg = yaml.safe_load(config.read_text())
    cfg["decode"]["max_workers"] = 2
    cfg["router"].update(heartbeat_timeout_s=1.0, retry_wait_s=90.0)  # a retry may wait for the replacement
    cfg["router"]["role_switching"] = {"mode": "manual"}
    cfg["prefill"]["kv_base_port"] = free_port()  # a prefill worker receives KV once it flips to decode
    config.write_text(yaml.safe_dump(cfg))
    port = cfg["router"]["grpc_port"]
    up = start_up(tmp_path, config)
    try:
        st = status(config, tmp_path)
        assert st["ready"] and st["pools"]["decode"] == {"workers": 1, "target": 1, "max_workers": 2,
                                                         "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                                                         "autoscaling": None}
        assert [(w["worker_id"], w["healthy"]) for w in st["workers"]] == [("prefill-0", True), ("decode-0", True)]
        too_many = pdserve("scale", str(config), "--decode", "3", tmp_path=tmp_path)
        assert too_many.returncode == 1 and "outside 1..2" in too_many.stderr and "decode.max_workers" in too_many.stderr

        grow = pdserve("scale", str(config), "--decode", "2", tmp_path=tmp_path, timeout=300)
        assert grow.returncode == 0, grow.stderr
        assert "decode: 2 workers; added decode-1 (serving)" in grow.stdout
        # scale returned once the router had decode-1's heartbeat: status shows it healthy at once
        assert all(w["healthy"] for w in status(config, tmp_path)["workers"]), status(config, tmp_path)["workers"]
        concurrent_mix_matches_hf(port, hf_tiny)
        cached = {w["worker_id"]: w["kv_pages"]["cached"] for w in status(config, tmp_path)["workers"]}
        assert cached["decode-1"] > 0, cached  # the new worker took traffic (its prefix cache kept the pages)
        prefill = next(w for w in status(config, tmp_path)["workers"] if w["worker_id"] == "prefill-0")
        assert prefill["rejected"] == {}  # told decode-1's KV address before the router sent it there
        targets = json.loads(next((tmp_path / "run").glob("*.prometheus.json")).read_text())
        assert "decode-1" in {t["labels"].get("worker_id") for t in targets}

        # Flip decode-1 to prefill with no restart: two prefill workers now, requests still HF's.
        pid = {w["worker_id"]: w["pid"] for w in status(config, tmp_path)["workers"]}
        only = pdserve("role", str(config), "decode-0", "decode", tmp_path=tmp_path)
        assert only.returncode == 1 and "already serves decode" in only.stderr
        flip = pdserve("role", str(config), "decode-1", "prefill", "--reason", "test: prompts queue", tmp_path=tmp_path)
        assert flip.returncode == 0, flip.stderr
        assert "decode-1 now serves prefill (was decode)" in flip.stdout
        concurrent_mix_matches_hf(port, hf_tiny)
        workers = {w["worker_id"]: w for w in status(config, tmp_path)["workers"]}
        assert workers["decode-1"]["role"] == "prefill" and workers["decode-1"]["serving_as"] == "prefill"
        assert workers["decode-1"]["pid"] == pid["decode-1"]  # the same process
        assert workers["decode-1"]["last_flip"]["reason"] == "test: prompts queue"
        assert set(workers["decode-1"]["kv_links"]) == {"decode-0"}  # it ships KV to the decode worker
        text = pdserve("status", str(config), tmp_path=tmp_path).stdout
        assert "decode-1 -> prefill by manual" in text and "test: prompts queue" in text
        back = pdserve("role", str(config), "decode-1", "decode", tmp_path=tmp_path)
        assert back.returncode == 0, back.stderr

        # Shrink while long requests stream: decode-1 is drained, its requests finish normally.
        prompts = [[0] + list(range(700 + 20 * k, 720 + 20 * k)) for k in range(4)]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, ThreadPoolExecutor(4) as pool:
            stub = pdserve_pb2_grpc.GenerationStub(channel)

            def stream(stub, p):
                req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=p),
                                         sampling=pb.SamplingParams(max_tokens=40, ignore_eos=True))
                return [t for r in stub.Generate(req, timeout=120) for t in r.token_ids]

            futures = [pool.submit(stream, stub, p) for p in prompts]
            time.sleep(1.0)
            shrink = pdserve("scale", str(config), "--decode", "1", tmp_path=tmp_path, timeout=300)
            assert shrink.returncode == 0, shrink.stderr
            assert "drained and removed decode-1" in shrink.stdout and "cut off" not in shrink.stdout
            for p, f in zip(prompts, futures):
                assert f.result() == hf_greedy(hf_tiny, p, 40)[0]
        st = status(config, tmp_path)
        assert [w["worker_id"] for w in st["workers"]] == ["prefill-0", "decode-0"]

        # Kill decode-0's process mid-stream: the supervisor starts a new one at the same index.
        old_pid = st["workers"][1].get("pid")
        assert old_pid, st
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, ThreadPoolExecutor(1) as pool:
            stub = pdserve_pb2_grpc.GenerationStub(channel)
            future = pool.submit(stream, stub, prompts[0])
            time.sleep(1.5)
            os.kill(old_pid, signal.SIGKILL)
            assert future.result() == hf_greedy(hf_tiny, prompts[0], 40)[0]  # resumed on the replacement
        def replacement():
            return next((w for w in status(config, tmp_path)["workers"] if w["worker_id"] == "decode-0"
                         and w.get("healthy") and w.get("pid") not in (None, old_pid)), None)

        fresh = wait_for(replacement, "decode-0 replaced")
        assert fresh["pid"] != old_pid
        concurrent_mix_matches_hf(port, hf_tiny)
        down = pdserve("down", str(config), tmp_path=tmp_path)
        assert down.returncode == 0, down.stderr
        assert up.wait(timeout=60) == 0
    finally:
        stop_up(up)


def test_sharded_worker_that_cannot_be_placed_names_its_bundles(tmp_path):
    config = write_config(tmp_path, "disaggregated", engines={"prefill": {"tensor_parallel_size": 2}},
                          num_cpus_per_worker=8)  # 2 x 8 CPUs on a machine Ray sees with far fewer
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "up", str(config), "--timeout", "5"],
                          capture_output=True, text=True, timeout=120, env=env(tmp_path), cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert "prefill-0: its 2 shards ({'CPU': 8.0} each, STRICT_PACK) could not be placed" in proc.stderr
    assert "available" in proc.stderr


def test_up_names_workers_that_cannot_be_placed(tmp_path):
    config = write_config(tmp_path, "disaggregated", num_gpus_per_worker=1.0)  # no GPU here
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "up", str(config), "--timeout", "8"],
                          capture_output=True, text=True, timeout=120, env=env(tmp_path), cwd=REPO)
    assert proc.returncode == 2
    assert "prefill-0" in proc.stderr and "decode-0" in proc.stderr and "did not start" in proc.stderr
    assert "available" in proc.stderr


def test_generate_without_a_cluster_is_a_clear_error(tmp_path):
    proc = pdserve("generate", "hi", "--address", f"127.0.0.1:{free_port()}", "--timeout", "3", tmp_path=tmp_path)
    assert proc.returncode == 1 and "UNAVAILABLE" in proc.stderr


def test_demo_runs_the_readme_main_job(tmp_path):
    config = write_config(tmp_path, "disaggregated")
    cfg = yaml.safe_load(config.read_text())
    cfg["router"]["http_port"] = free_port()  # the HTTP front door starts (and stops) with it
    config.write_text(yaml.safe_dump(cfg))
    proc = pdserve("demo", str(config), "def fibonacci(n):", "--max-tokens", "16", "--ignore-eos",
                   tmp_path=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    offline = pdserve("complete", "def fibonacci(n):", "--max-tokens", "16", "--ignore-eos", tmp_path=tmp_path)
    assert offline.stdout.strip() in proc.stdout
    assert "cluster stopped" in proc.stdout
    assert f"OpenAI-compatible HTTP on 127.0.0.1:{cfg['router']['http_port']}" in proc.stdout
