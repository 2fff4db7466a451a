"""Driving `pdserve` as a user does, from tests: the CLI as subprocesses with the run dir
under the test's tmp_path, `pdserve up` in its own session (stopped by SIGINT to that group),
`pdserve status --json`, and polling with a deadline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.local_cluster import free_port

REPO = Path(__file__).resolve().parents[1]


def env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PDSERVE_RUN_DIR": str(tmp_path / "run"), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "PYTHONUNBUFFERED": "1"}


def pdserve(*args, tmp_path, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env(tmp_path), cwd=REPO)


def _as_a_background_job() -> None:
    """What a non-interactive shell does to `pdserve up &`: the job starts with SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def start_up(tmp_path: Path, config: Path) -> subprocess.Popen:
    """`pdserve up` in its own session, started as a script's background job would be (SIGINT
    ignored: `stop_up` proves it still stops on SIGINT), returned once it says the cluster is up."""
    log = open(tmp_path / "up.log", "w")
    up = subprocess.Popen([sys.executable, "-m", "cluster.cli", "up", str(config)], stdout=log,
                          stderr=subprocess.STDOUT, env=env(tmp_path), cwd=REPO, start_new_session=True,
                          preexec_fn=_as_a_background_job)
    log.close()
    deadline = time.monotonic() + 180
    while "cluster up" not in (tmp_path / "up.log").read_text():
        if up.poll() is not None or time.monotonic() > deadline:
            stop_up(up)
            pytest.fail((tmp_path / "up.log").read_text())
        time.sleep(0.5)
    return up


def stop_up(up: subprocess.Popen) -> None:
    """SIGINT to `up`'s session (Ctrl-C); it must stop cleanly, exit status 0."""
    if up.poll() is None:
        os.killpg(up.pid, signal.SIGINT)
        assert up.wait(60) == 0, f"pdserve up exited with {up.returncode} after SIGINT"


def status(config: Path, tmp_path: Path) -> dict:
    proc = pdserve("status", str(config), "--json", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def wait_for(predicate, what: str, timeout_s: float = 90.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
    return value


def write_config(tmp_path: Path, mode: str, transport: str = "zmq", engines: dict | None = None,
                 **pool_extra) -> Path:
    """`engines`: per-role engine keys (e.g. TP/PP sizes); `pool_extra`: keys for every pool."""
    cfg = yaml.safe_load((REPO / "configs" / ("local.yaml" if mode == "disaggregated" else "colocated.yaml")).read_text())
    cfg["router"].update(grpc_port=free_port(), worker_event_port=free_port(), http_port=free_port(),
                         control_port=free_port())
    cfg["logging"] = {"format": "json"}
    cfg["flight_recorder"] = {"dump_dir": str(tmp_path / "flight-signals")}  # SIGUSR1 and overrun dumps
    if mode == "disaggregated":
        cfg["kv_transfer"].update(transport=transport, dist_port=free_port())
    for role in ("prefill", "decode", "colocated"):
        if role in cfg:
            cfg[role]["base_port"] = free_port()
            cfg[role]["metrics_base_port"] = free_port()
            cfg[role]["num_cpus_per_worker"] = 0.5  # two workers + router on a 2-core machine
            cfg[role].update(pool_extra)
            cfg[role]["engine"].update((engines or {}).get(role, {}))
            if cfg[role]["engine"].get("tensor_parallel_size", 1) * cfg[role]["engine"].get("pipeline_parallel_size", 1) > 1:
                cfg[role]["shard_base_port"] = free_port()
            if role == "decode":
                cfg[role]["kv_base_port"] = free_port()
    path = tmp_path / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path
