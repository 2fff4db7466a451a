"""How close `pdserve advise` comes to real runs: measured goodput of each layout on three
workloads against what the simulator predicted for the same request streams, on this machine.

For each workload (chat: the mixed stream of benchmarks/pd_goodput.py at 2/s; long: 1536-token
prompts at 0.25/s, TTFT target 8 s; prefix: 4 shared 512-token prefixes + 16-token suffixes at
2/s) it runs `pdserve bench compare` over the
layouts (cluster/bench_compare.py, each cluster up, driven, down), then profiles the model once
(cluster/advise/profile.py) and predicts every layout on the stream that was sent. Prints, per
workload and layout, measured and predicted goodput, the error, whether the ranking agrees, and
how long advising took (profiling included once).

    python benchmarks/advise_validate.py                     # 3 layouts x 3 workloads, ~12 min
    python benchmarks/advise_validate.py --workloads chat --num-prompts 24
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

from cluster.advise.layouts import layout_of
from cluster.advise.profile import profile
from cluster.advise.report import Workload, advise
from cluster.bench_compare import run_compare
from loadgen.metrics import SLO
from loadgen.runner import BenchPlan
from loadgen.workloads import LengthDist, WorkloadSpec

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "bench"
LAYOUTS = ("colocated-small", "disagg-small", "disagg-adaptive-small")


def workloads(num_prompts: int) -> dict[str, tuple[WorkloadSpec, float, float]]:
    """name -> (spec, requests/s, TTFT target s): long prompts at a rate and TTFT target a
    1536-token prefill (about 4 s on one Zen 3 core for builtin:small) can meet at all."""
    return {
        "chat": (WorkloadSpec("mixed", num_prompts, LengthDist(64), LengthDist(32), seed=0, long_fraction=0.125,
                              long_factor=16), 2.0, 2.0),
        "long": (WorkloadSpec("fixed", max(8, num_prompts // 2), LengthDist(1536), LengthDist(32), seed=1), 0.25, 8.0),
        "prefix": (WorkloadSpec("prefix", num_prompts, LengthDist(512), LengthDist(32), seed=2, num_prefixes=4),
                   2.0, 2.0),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="chat,long,prefix", help="subset of chat,long,prefix")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="configs/bench YAML names")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests per workload (default 32; long: half)")
    parser.add_argument("--slo-tpot", type=float, default=0.15, help="TPOT target, s (default 0.15)")
    parser.add_argument("--out", default="bench-advise", help="results directory (default bench-advise)")
    args = parser.parse_args()
    names = [n.strip() for n in args.layouts.split(",")]
    paths = [CONFIGS / f"{n}.yaml" for n in names]
    specs = {k: v for k, v in workloads(args.num_prompts).items() if k in args.workloads.split(",")}
    measured, slos = {}, {}
    for key, (spec, rate, ttft_s) in specs.items():
        slos[key] = slo = SLO(ttft_s, args.slo_tpot)
        plan = BenchPlan(spec, (rate,), slo=slo)
        results = run_compare(paths, plan, "grpc", Path(args.out) / key, progress=False)
        measured[key] = dict(zip(names, results, strict=True))
    start = time.perf_counter()
    cores = os.cpu_count() or 1
    layouts = [layout_of(p, cores) for p in paths]
    costs = profile("builtin:small", {w.threads for layout in layouts for w in layout.workers}, budget=2048)
    costs.save(Path(args.out) / "costs.json")
    profiled_s = time.perf_counter() - start
    print(f"\npdserve advise against real runs (TPOT target {args.slo_tpot * 1000:g} ms, {cores} cores, {costs.cpu}); "
          f"profiling took {profiled_s:.1f} s")
    for key, (spec, rate, ttft_s) in specs.items():
        print(f"  {key}: {spec.num_prompts} requests ({spec.name}) at {rate:g}/s, TTFT target {ttft_s:g} s")
    print("| workload | layout | measured goodput | predicted | error | measured TTFT p50/p90 ms | predicted |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for key, by_layout in measured.items():
        slo = slos[key]
        t0 = time.perf_counter()
        advice = advise(layouts, costs, Workload.of(by_layout[names[0]]), slo)
        took = time.perf_counter() - t0
        real = {}
        for name in names:
            m = by_layout[name].runs[0].summary(slo)
            p = advice.predictions[name, by_layout[name].runs[0].rate].summary
            real[name] = m.goodput
            err = (p.goodput - m.goodput) / m.goodput if m.goodput > 0 else math.nan
            if math.isfinite(err):
                worst = max(worst, abs(err))
            print(f"| {key} | {name} | {m.goodput:.2f} | {p.goodput:.2f} | {err:+.0%} | "
                  f"{m.ttft['p50'] * 1000:.0f}/{m.ttft['p90'] * 1000:.0f} | "
                  f"{p.ttft['p50'] * 1000:.0f}/{p.ttft['p90'] * 1000:.0f} |")
        ranked_real = sorted(names, key=lambda n: -real[n])
        ranked_pred = sorted(names, key=lambda n: -advice.predictions[n, by_layout[n].runs[0].rate].summary.goodput)
        print(f"|  {key}: ranking {'agrees' if ranked_real == ranked_pred else 'DIFFERS'} (measured "
              f"{' > '.join(ranked_real)}; predicted {' > '.join(ranked_pred)}); recommended {advice.recommended}; "
              f"simulated in {took:.2f} s | | | | | | |")
    print(f"largest goodput error: {worst:.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
