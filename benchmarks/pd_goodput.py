"""Goodput of disaggregated layouts against colocated serving, on one request stream.

Runs `pdserve bench compare` (cluster/bench_compare.py) over five builtin:small clusters that
share the machine's two cores: colocated (one engine), 1P1D, 1P2D and 2P1D (every prompt on a
prefill worker: router.disaggregation always), adaptive (1P1D placing each prompt where the
measured costs say, router/placement/) and switching (three workers starting as 1P2D, adaptive
placement, and the router flipping roles as the TTFT and TPOT say, router/role_switch/; and
switching-always, the same with every prompt on a prefill worker, so only the mix adapts), each brought up,
driven with the same seeded mixed workload at each rate, and brought down before the next.
Prints, per layout and rate, goodput (requests/s meeting both the TTFT and the TPOT target)
and SLO attainment with ratios against colocated, and the highest rate that keeps >= 90%
attainment; writes the JSON/CSV results, plots and compare.md to --out.

    python benchmarks/pd_goodput.py                       # the defaults below, ~25 minutes
    python benchmarks/pd_goodput.py --rates 0.5,1 --num-prompts 24 --out /tmp/goodput
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from cluster.bench_compare import run_compare
from loadgen.metrics import SLO, max_rate_at_attainment
from loadgen.runner import BenchPlan
from loadgen.workloads import LengthDist, WorkloadSpec

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "bench"
LAYOUTS = {"colocated": "colocated-small.yaml", "1P1D": "disagg-small.yaml", "1P2D": "disagg-1p2d-small.yaml",
           "2P1D": "disagg-2p1d-small.yaml", "adaptive": "disagg-adaptive-small.yaml",
           "shared": "disagg-shared-small.yaml", "switching": "disagg-switching-small.yaml",
           "switching-always": "disagg-switching-always-small.yaml"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="0.5,1,2,3", help="requests/s, one run each (default 0.5,1,2,3)")
    parser.add_argument("--num-prompts", type=int, default=48, help="requests per rate (default 48)")
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT target, seconds (default 2)")
    parser.add_argument("--slo-tpot", type=float, default=0.15, help="TPOT target, seconds (default 0.15)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"subset of {','.join(LAYOUTS)}")
    parser.add_argument("--out", default="bench-goodput", help="results directory (default bench-goodput)")
    args = parser.parse_args()
    layouts = [name.strip() for name in args.layouts.split(",")]
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layouts {unknown}; choose from {list(LAYOUTS)}")
    spec = WorkloadSpec("mixed", args.num_prompts, LengthDist(64), LengthDist(32), seed=0, long_fraction=0.125,
                        long_factor=16)
    slo = SLO(args.slo_ttft, args.slo_tpot)
    plan = BenchPlan(spec, tuple(float(r) for r in args.rates.split(",")), slo=slo)
    results = run_compare([CONFIGS / LAYOUTS[name] for name in layouts], plan, "grpc", Path(args.out),
                          progress=False)
    base = {run.rate: run.summary(slo).goodput for run in results[0].runs}
    print(f"\ngoodput (req/s meeting TTFT <= {args.slo_ttft:g} s and TPOT <= {1000 * args.slo_tpot:g} ms), "
          f"ratio against {layouts[0]}:")
    print(f"| layout | {' | '.join(f'{run.rate:g} req/s' for run in results[0].runs)} | max rate at 90% attainment |")
    print("|---|" + "---|" * (len(results[0].runs) + 1))
    for name, result in zip(layouts, results):
        cells = []
        for run in result.runs:
            summary = run.summary(slo)
            ratio = summary.goodput / base[run.rate] if base[run.rate] else math.nan
            cells.append(f"{summary.goodput:.2f} ({ratio:.2f}x, {summary.attainment:.0%})")
        best = max_rate_at_attainment([run.rate for run in result.runs],
                                      [run.summary(slo).attainment for run in result.runs], 0.9)
        print(f"| {name} | {' | '.join(cells)} | {'-' if math.isnan(best) else f'{best:.2f} req/s'} |")
    print("\nTTFT and TPOT p50/p90/p99 (ms), failed requests:")
    print("| layout | rate | TTFT p50/p90/p99 | TPOT p50/p90/p99 | failed |")
    print("|---|---|---|---|---|")
    for name, result in zip(layouts, results):
        for run in result.runs:
            s = run.summary(slo)
            ttft, tpot = ("/".join(f"{1000 * d[p]:.0f}" for p in ("p50", "p90", "p99")) for d in (s.ttft, s.tpot))
            print(f"| {name} | {run.rate:g} | {ttft} | {tpot} | {s.num_failed} |")
    for name in ADAPTIVE:
        if name in layouts and any(n not in ADAPTIVE for n in layouts):
            print_against_best_fixed(name, layouts, results, slo)
    return 0


ADAPTIVE = ("adaptive", "switching", "switching-always")  # the layouts that decide as they serve


def print_against_best_fixed(adaptive_name: str, layouts: list[str], results: list, slo: SLO) -> None:
    """The issue's bar: an adaptive layout's goodput against the best fixed layout's at each rate."""
    adaptive = results[layouts.index(adaptive_name)]
    print(f"\n{adaptive_name} against the best fixed layout at each rate:")
    for i, run in enumerate(adaptive.runs):
        others = [(r.runs[i].summary(slo).goodput, n) for n, r in zip(layouts, results) if n not in ADAPTIVE]
        best, name = max(others)
        mine = run.summary(slo).goodput
        print(f"  {run.rate:g} req/s: {adaptive_name} {mine:.2f}, best fixed {name} {best:.2f} -> "
              f"{mine / best if best else math.nan:.2f}x")


if __name__ == "__main__":
    raise SystemExit(main())
