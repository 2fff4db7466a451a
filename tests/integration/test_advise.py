"""`pdserve advise` end to end: the profiler measures positive step costs and a link on the
real engine (builtin:tiny), saved costs load back, and the command prints every layout's
predicted goodput per rate of a recorded workload and recommends the layout that serves it best:
here a burst of long prompts, where two prefill workers beat one colocated engine on the
machine's two cores by the given costs."""

from __future__ import annotations

import math

from cluster.advise.costs import Costs, LinkCost, StepCost
from cluster.advise.profile import profile
from cluster.cli import main as pdserve
from loadgen.metrics import SLO, RequestRecord
from loadgen.results import BenchResult, BenchRun, write_result

CONFIGS = "configs/bench"


def test_the_profiler_measures_the_engine_and_the_link(tmp_path):
    costs = profile("builtin:tiny", [1, 2], budget=128, say=lambda line: None)
    for threads in (1, 2):
        step = costs.step(threads)
        assert step.fixed_s > 0 and step.per_prompt_token_s > 0 and step.per_sequence_s >= 0
        assert step.step_s(128, 0) < 5.0  # a tiny model's full chunk
    assert costs.kv_bytes_per_token > 0 and costs.link.bytes_per_s > 1e7 and 0 < costs.link.latency_s < 0.1
    costs.save(tmp_path / "costs.json")
    assert Costs.load(tmp_path / "costs.json") == costs


def test_advise_prints_every_layout_and_recommends_one(tmp_path, capsys):
    # A 2 req/s stream and a burst of 16 prompts of 1500 tokens, 8 output tokens each.
    runs = []
    for rate in (2.0, math.inf):
        records = tuple(RequestRecord(0.0 if math.isinf(rate) else i / rate, (1.0,), 8, 1500) for i in range(16))
        runs.append(BenchRun(rate, 10.0, records))
    write_result(BenchResult("long", "grpc", "x", {}, SLO(3.0, 0.2), 1.0, None, tuple(runs)), tmp_path, "long")
    # By these costs prefill dominates and a second thread buys little: two prefill workers win.
    costs = Costs("builtin:small", {1: StepCost(0.01, 0.0004, 0.001), 2: StepCost(0.008, 0.00033, 0.0008)}, 1000,
                  LinkCost(0.0002, 2e9), "test CPU")
    costs.save(tmp_path / "costs.json")
    rc = pdserve(["advise", str(tmp_path / "long.json"), f"{CONFIGS}/colocated-small.yaml", f"{CONFIGS}/disagg-small.yaml",
                  f"{CONFIGS}/disagg-2p1d-small.yaml", "--costs", str(tmp_path / "costs.json"), "--cores", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for name in ("colocated-small", "disagg-small", "disagg-2p1d-small"):
        assert sum(line.startswith(f"  {name} ") for line in out.splitlines()) == 2, out  # one row per rate
    assert "recommended: disagg-2p1d-small" in out, out
    # Measured results of the same layouts add the error column.
    measured = tmp_path / "measured"
    write_result(BenchResult("disagg-small", "grpc", "x", {}, SLO(3.0, 0.2), 1.0, None, tuple(runs)), measured)
    assert pdserve(["advise", str(tmp_path / "long.json"), f"{CONFIGS}/disagg-small.yaml", "--costs",
                    str(tmp_path / "costs.json"), "--measured", str(measured)]) == 0
    assert "measured" in capsys.readouterr().out
