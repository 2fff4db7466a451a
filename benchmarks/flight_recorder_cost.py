"""What the flight recorder (proto/flight/) costs a serving cluster: throughput with it on and off.

Two measurements, printed side by side:
  1. Served: `pdserve bench compare` (cluster/bench_compare.py) of one cluster config with
     `flight_recorder.enabled` true and false, in pairs whose order alternates (off, on, then on,
     off, ...) so drift on the machine falls on both sides alike; the same seeded burst each time.
     Prints each pair's request throughput, the on/off ratio, and TTFT/TPOT p50/p90/p99.
  2. Per entry: the recorder's cost per recorded message and state change, timed in a loop, and
     what that comes to per request at the entries one request makes, against the served time
     per request.

    python benchmarks/flight_recorder_cost.py                         # 2 pairs of 96-prompt bursts, ~6 min
    python benchmarks/flight_recorder_cost.py --pairs 3 --config configs/bench/colocated-small.yaml
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import yaml

from cluster.bench_compare import run_compare
from loadgen.metrics import SLO
from loadgen.runner import BenchPlan
from loadgen.workloads import LengthDist, WorkloadSpec
from proto import worker_messages as wm
from proto.flight.recorder import OUT, FlightRecorder

REPO = Path(__file__).resolve().parents[1]
# Entries one disaggregated request leaves in the three rings (router, prefill, decode), counted
# on an in-process 1P1D cluster (LocalCluster, builtin:tiny): 37 at 8 output tokens, 149 at 64,
# i.e. 23 outside decoding plus one Tokens event on the decode worker and one at the router for
# each token after the first.
ENTRIES_PER_REQUEST = 23 + 2 * 63


def variant(base: Path, out: Path, enabled: bool, tag: str) -> Path:
    cfg = yaml.safe_load(base.read_text())
    cfg["flight_recorder"] = {"enabled": enabled, "dump_dir": str(out / "dumps")}
    path = out / f"recorder-{'on' if enabled else 'off'}-{tag}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def per_entry_s(n: int = 200_000) -> float:
    """Seconds one recorded message plus one state change take (the two kinds of entry)."""
    r = FlightRecorder("decode", "decode-0", capacity=4096)
    encoded = wm.encode(wm.Tokens("r" * 24, "decode-0", (1,), (), False, None))
    fields = {"pages": 3}
    start = time.perf_counter()
    for _ in range(n):
        r.message(OUT, "router", "r" * 24, encoded)
        r.state("reserved", "r" * 24, fields)
    return (time.perf_counter() - start) / (2 * n)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs/bench/disagg-adaptive-small.yaml"),
                        help="the cluster measured (default configs/bench/disagg-adaptive-small.yaml)")
    parser.add_argument("--pairs", type=int, default=2, help="off/on pairs, order alternating (default 2)")
    parser.add_argument("--num-prompts", type=int, default=96, help="requests per burst (default 96)")
    parser.add_argument("--out", default="bench-flight-cost", help="results directory (default bench-flight-cost)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = WorkloadSpec("throughput", args.num_prompts, LengthDist(256, "fixed", 0.0), LengthDist(64, "fixed", 0.0),
                        seed=0)
    plan = BenchPlan(spec, (float("inf"),), 1.0, None, SLO(None, None), 4)
    rows = []
    for i in range(args.pairs):
        order = [False, True] if i % 2 == 0 else [True, False]
        paths = [variant(Path(args.config), out, enabled, str(i)) for enabled in order]
        results = run_compare(paths, plan, "grpc", out / f"pair-{i}", progress=False)
        by = {enabled: result.runs[0].summary() for enabled, result in zip(order, results, strict=True)}
        rows.append(by)
    print(f"\nflight recorder cost: {Path(args.config).name}, {args.num_prompts}-prompt bursts (256 in, 64 out)")
    print(f"{'pair':<5} {'off req/s':>9} {'on req/s':>9} {'on/off':>7}   "
          f"{'TTFT p50/p90/p99 off':>22} {'on':>20}   {'TPOT p50/p90/p99 off':>22} {'on':>20}")

    def pct(d: dict) -> str:
        return "/".join(f"{d.get(p, float('nan')) * 1000:.0f}" for p in ("p50", "p90", "p99")) + " ms"

    ratios = []
    for i, by in enumerate(rows):
        off, on = by[False], by[True]
        ratio = on.request_throughput / off.request_throughput
        ratios.append(ratio)
        print(f"{i:<5} {off.request_throughput:>9.3f} {on.request_throughput:>9.3f} {ratio:>7.3f}   "
              f"{pct(off.ttft):>22} {pct(on.ttft):>20}   {pct(off.tpot):>22} {pct(on.tpot):>20}")
        if off.num_failed or on.num_failed:
            print(f"      failed requests: off {off.num_failed}, on {on.num_failed}")
    print(f"on/off throughput: mean {statistics.mean(ratios):.3f} over {len(ratios)} pairs "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    entry_s = per_entry_s()
    served_s = 1.0 / statistics.mean(r[False].request_throughput for r in rows)
    share = ENTRIES_PER_REQUEST * entry_s / served_s
    print(f"per entry: {entry_s * 1e9:.0f} ns; x {ENTRIES_PER_REQUEST} entries a request = "
          f"{ENTRIES_PER_REQUEST * entry_s * 1e6:.1f} us of {served_s * 1e3:.0f} ms served per request "
          f"({share * 100:.3f}% of throughput, an upper bound: the three processes record in parallel)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
