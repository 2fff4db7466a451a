"""`pdserve bench compare` as a user runs it: two tiny cluster configs (colocated and
disaggregated) brought up on Ray one after another in one subprocess, the mixed workload at two
rates against each over OpenAI HTTP, results and overlay plots written, the ratio table printed, and no process
of either cluster left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.cli_helpers import REPO, env, write_config
from tests.local_cluster import free_port

pytestmark = [pytest.mark.ray, pytest.mark.cluster]


def processes_with_env(key: str, value: str) -> list[str]:
    """Processes (of any parent) whose environment has key=value: everything a run started."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if f"{key}={value}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ")[:120]
                found.append(f"{proc.name}: {cmdline!r}")
        except OSError:  # gone, or not ours to read
            continue
    return found


@pytest.mark.slow
def test_compare_colocated_and_disaggregated(tmp_path):
    colocated, disaggregated = write_config(tmp_path, "colocated"), write_config(tmp_path, "disaggregated")
    for config in (colocated, disaggregated):  # measured through the OpenAI HTTP front door
        cfg = yaml.safe_load(config.read_text())
        cfg["router"]["http_port"] = free_port()
        config.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "bench", "compare", str(colocated), str(disaggregated),
         "--workload", "mixed", "--num-prompts", "6", "--input-len", "16", "--long-fraction", "0.3",
         "--output-len", "6", "--rates", "10,20", "--slo-ttft", "30", "--slo-tpot", "30",
         "--backend", "openai", "--out", str(out), "--no-progress"],
        check=False, capture_output=True, text=True, timeout=240, env=env(tmp_path), cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    elapsed = time.monotonic() - start
    assert processes_with_env("PDSERVE_RUN_DIR", str(tmp_path / "run")) == []
    for label in ("colocated", "disaggregated"):
        data = json.loads((out / f"{label}.json").read_text())
        assert data["label"] == label and [run["rate"] for run in data["runs"]] == [10.0, 20.0]
        for run in data["runs"]:
            assert all(r["ok"] and r["output_tokens"] == 6 for r in run["requests"])
            assert {r["prompt_tokens"] for r in run["requests"]} <= {16, 128}
        assert (out / f"{label}.csv").is_file()
    # Identical traffic for both systems: same prompts' lengths and classes in the same order.
    shapes = [[(r["prompt_tokens"], r["kind"]) for run in json.loads((out / f"{label}.json").read_text())["runs"]
               for r in run["requests"]] for label in ("colocated", "disaggregated")]
    assert shapes[0] == shapes[1]
    for png in ("latency_cdf.png", "attainment_vs_rate.png", "attainment_vs_slo_scale.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    table = (out / "compare.md").read_text()
    assert table.splitlines()[0].startswith("| config | rate | req/s |") and "short TPOT p99" in table
    rows = [line for line in table.splitlines() if line.startswith("| disaggregated |")]
    assert len(rows) == 2 and all("x)" in row for row in rows)  # ratios against colocated
    assert table.strip() in proc.stdout
    assert proc.stdout.count("cluster stopped") == 2
    print(f"bench compare of two tiny clusters took {elapsed:.1f} s")
