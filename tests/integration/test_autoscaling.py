"""The decode pool grows onto a new Ray node under load and shrinks off it when idle, with
nothing failing in between. A Ray head with the fake multi-node provider and the project's own
autoscaling YAML (configs/ray/fake-multinode.yaml) runs as a child of this test; `pdserve up`
joins it. A second decode worker needs a decode_slot the head has no more of, so the Ray
autoscaler must start a pdserve.decode node for it; once the load stops and the worker is
drained away, the idle node is removed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.cli_helpers import REPO, env, pdserve, start_up, status, stop_up, wait_for
from tests.helpers import hf_greedy
from tests.local_cluster import free_port

pytestmark = [pytest.mark.ray, pytest.mark.cluster]

PROMPTS = [[0] + list(range(100 + 50 * k, 140 + 50 * k)) for k in range(4)]
MAX_TOKENS = 48


@pytest.fixture
def fake_ray(tmp_path):
    """A fake multi-node Ray head (autoscaler included) in its own session; stopped with SIGINT."""
    port = free_port()
    # Token auth off: a loopback-only test cluster, joined by clients that carry no token.
    head_env = {**env(tmp_path), "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
                "RAY_AUTH_MODE": "disabled"}
    autoscaling = yaml.safe_load((REPO / "configs" / "ray" / "fake-multinode.yaml").read_text())
    autoscaling["provider"]["gcs_address"] = f"127.0.0.1:{port}"  # where the fake nodes join
    (tmp_path / "fake-multinode.yaml").write_text(yaml.safe_dump(autoscaling))
    log = open(tmp_path / "ray-head.log", "w")
    head = subprocess.Popen(
        [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--port", str(port),
         "--num-cpus", "2", "--resources", json.dumps({"prefill_slot": 1, "decode_slot": 1}),
         "--include-dashboard", "false", "--autoscaling-config", str(tmp_path / "fake-multinode.yaml")],
        stdout=log, stderr=subprocess.STDOUT, env=head_env, cwd=tmp_path, start_new_session=True,
        preexec_fn=_sigint_default)
    log.close()
    try:
        wait_for(lambda: alive_nodes(port, tmp_path) == 1, "the Ray head", 90)
        yield port
    finally:
        os.killpg(head.pid, signal.SIGINT)
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:  # never leave a Ray cluster behind
            os.killpg(head.pid, signal.SIGTERM)
            head.wait(30)


def _sigint_default() -> None:
    """The head stops on SIGINT even when this test runs as a background job (which starts with
    SIGINT ignored, inherited by every child)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def alive_nodes(port: int, tmp_path: Path) -> int | None:
    """Alive Ray nodes, asked from a short-lived driver (this process stays out of Ray)."""
    probe = subprocess.run(
        [sys.executable, "-c", f"import ray; ray.init(address='127.0.0.1:{port}', logging_level='ERROR', "
                               "log_to_driver=False); print('alive-nodes', sum(n['Alive'] for n in ray.nodes()))"],
        capture_output=True, text=True, timeout=60, env=env(tmp_path))
    counts = [line.split()[1] for line in probe.stdout.splitlines() if line.startswith("alive-nodes ")]
    return int(counts[-1]) if probe.returncode == 0 and counts else None


@pytest.mark.slow
def test_decode_pool_grows_onto_a_new_node_and_shrinks_off_it(tmp_path, fake_ray, hf_tiny):
    cfg = yaml.safe_load((REPO / "configs" / "autoscaling-local.yaml").read_text())
    cfg["ray"]["address"] = f"127.0.0.1:{fake_ray}"
    cfg["router"].update(grpc_port=free_port(), worker_event_port=free_port(), control_port=free_port(),
                         heartbeat_timeout_s=2.0)
    del cfg["prefill"]["autoscaling"]  # only decode scales here
    cfg["prefill"].update(base_port=free_port())
    cfg["decode"].update(base_port=free_port(), kv_base_port=free_port())
    cfg["prefill"]["engine"].update(page_size=8)
    cfg["decode"]["engine"].update(page_size=8, num_pages=64)  # 4 requests in flight fill ~70%
    cfg["decode"]["autoscaling"].update(target_kv_usage=0.3, target_tpot_ms=None, scale_down_delay_s=3,
                                        interval_s=1, cooldown_s=0)
    config = tmp_path / "autoscaling.yaml"
    config.write_text(yaml.safe_dump(cfg))
    expected = [hf_greedy(hf_tiny, p, MAX_TOKENS)[0] for p in PROMPTS]
    up = start_up(tmp_path, config)
    stop_load = threading.Event()
    outcomes: list[tuple[int, object]] = []

    def load(k: int) -> None:
        import grpc

        from proto import pdserve_pb2 as pb
        from proto import pdserve_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{cfg['router']['grpc_port']}") as channel:
            stub = pdserve_pb2_grpc.GenerationStub(channel)
            while not stop_load.is_set():
                req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPTS[k]),
                                         sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
                try:
                    outcomes.append((k, [t for r in stub.Generate(req, timeout=120) for t in r.token_ids]))
                except grpc.RpcError as exc:
                    outcomes.append((k, f"{exc.code().name}: {exc.details()}"))

    try:
        head_node = status(config, tmp_path)["workers"][1]["node_id"]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            for k in range(len(PROMPTS)):
                pool.submit(load, k)
            grown = wait_for(lambda: [w for w in status(config, tmp_path)["workers"]
                                      if w["worker_id"] == "decode-1" and w.get("healthy")], "decode-1 healthy", 150)
            assert grown[0]["node_id"] != head_node  # it needed the new node's decode_slot
            assert alive_nodes(fake_ray, tmp_path) == 2
            served = len(outcomes)
            wait_for(lambda: len(outcomes) > served + 8, "traffic after the scale-up")
            stop_load.set()
        st = wait_for(lambda: (s := status(config, tmp_path)) and len(s["workers"]) == 2 and s, "decode-1 removed", 90)
        assert [w["worker_id"] for w in st["workers"]] == ["prefill-0", "decode-0"]
        assert st["pools"]["decode"]["autoscaling"]["wanted"] == 1
        wait_for(lambda: alive_nodes(fake_ray, tmp_path) == 1, "the idle decode node removed", 90)
        failures = [(k, got) for k, got in outcomes if got != expected[k]]
        assert not failures, failures[:3]
        assert len(outcomes) > 8
        down = pdserve("down", str(config), tmp_path=tmp_path)
        assert down.returncode == 0, down.stderr
        assert up.wait(timeout=60) == 0
    finally:
        stop_load.set()
        stop_up(up)
