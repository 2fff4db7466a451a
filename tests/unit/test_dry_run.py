"""`pdserve up CONFIG --dry-run` (cluster/dry_run.py): every shipped config, the GPU ones
included, builds every worker's spec on a machine without Ray running, a model or a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cluster.dry_run import plan
from configs import load_cluster_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_plans_every_worker(path):
    config = load_cluster_config(path)
    lines = plan(config)
    assert lines[0].startswith("router: gRPC ")
    workers = [line.split(":")[0] for line in lines[1:] if ": commands " in line]
    expected = [f"{role}-{i}" for role in ("prefill", "decode", "colocated") if getattr(config, role) is not None
                for i in range(getattr(config, role).num_workers)]
    assert workers == expected


def test_the_gpu_config_names_its_devices_bundles_and_nccl_ranks():
    lines = plan(load_cluster_config(REPO / "configs/gpu.yaml"))
    decode = [line for line in lines if line.startswith("decode-")]
    assert len(decode) == 4
    assert all("cuda bfloat16" in line and "'GPU': 1.0" in line for line in lines[1:])
    # Each decode rank receives from the two prefill ranks by name (NCCL has no any-source receive).
    assert all("(from ranks 0, 1)" in line for line in decode)
    assert "KV group rank 5 of 6" in decode[-1]


def test_the_cli_dry_run_starts_nothing():
    code = ("import sys; from cluster.cli import main; rc = main(['up', 'configs/gpu.yaml', '--dry-run']); "
            "assert 'ray' not in sys.modules and 'torch' not in sys.modules, 'a dry run must not load Ray or torch'; "
            "sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "decode-3: commands" in out.stdout and "nothing started" in out.stdout
