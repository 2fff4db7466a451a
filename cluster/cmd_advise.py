"""`pdserve advise`: which layout to run for a workload, predicted from a short profiling run
(cluster/advise/profile.py) and a simulation of each layout (cluster/advise/simulator.py)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "bench"
DEFAULT_LAYOUTS = ("colocated-small", "disagg-small", "disagg-1p2d-small", "disagg-2p1d-small",
                   "disagg-adaptive-small")


def advise(args: argparse.Namespace) -> int:
    from cluster.advise.costs import Costs
    from cluster.advise.layouts import layout_of
    from cluster.advise.profile import profile
    from cluster.advise.report import Workload, lines
    from cluster.advise.report import advise as run_advice
    from configs import load_cluster_config
    from loadgen.metrics import SLO
    from loadgen.results import load_result

    start = time.perf_counter()
    result = load_result(args.workload)
    slo = SLO(args.slo_ttft if args.slo_ttft is not None else result.slo.ttft_s,
              args.slo_tpot if args.slo_tpot is not None else result.slo.tpot_s)
    if not slo.is_set():
        raise ValueError("goodput needs an SLO: the workload's result has none; give --slo-ttft and/or --slo-tpot")
    paths = [Path(p) for p in args.configs] or [CONFIGS / f"{name}.yaml" for name in DEFAULT_LAYOUTS]
    cores = args.cores or os.cpu_count() or 1
    layouts = [layout_of(p, cores) for p in paths]
    first = load_cluster_config(paths[0])
    if args.costs:
        costs = Costs.load(args.costs)
        print(f"pdserve: costs of {costs.model} from {args.costs} (measured on {costs.cpu or 'an unnamed CPU'})")
    else:
        pool = first.colocated or first.decode
        assert pool is not None
        threads = {w.threads for layout in layouts for w in layout.workers}
        print(f"pdserve: profiling {first.model} at {', '.join(map(str, sorted(threads)))} thread(s) ...")
        costs = profile(first.model, threads, budget=min(2048, pool.engine.max_num_batched_tokens),
                        dtype=pool.engine.dtype)
        if args.save_costs:
            costs.save(args.save_costs)
            print(f"pdserve: costs saved to {args.save_costs} (--costs {args.save_costs} skips profiling)")
    workload = Workload.of(result)
    measured = {}
    if args.measured:
        for path in sorted(Path(args.measured).glob("*.json")):
            try:
                measured[path.stem] = load_result(path)
            except ValueError:
                continue
    advice = run_advice(layouts, costs, workload, slo)
    print(f"pdserve: {sum(len(r) for _, r in workload.runs)} requests of {args.workload} on {cores} cores, "
          f"SLO TTFT {slo.ttft_s} s, TPOT {slo.tpot_s} s; predicted:")
    for line in lines(advice, measured, slo):
        print(line)
    print(f"pdserve: advised in {time.perf_counter() - start:.1f} s")
    return 0


def add_advise_command(sub) -> None:
    p = sub.add_parser(
        "advise", help="predict each layout's goodput on a recorded workload and recommend one",
        description="Profile the model's step costs on this machine (a few seconds per thread count), then "
        "simulate each layout (cluster YAMLs; default the five of benchmarks/pd_goodput.py) serving the requests "
        "of a 'pdserve bench' result, rate by rate, and print each one's predicted goodput, SLO attainment and "
        "TTFT/TPOT percentiles, and the layout with the highest goodput. --measured DIR (bench compare results, "
        "one JSON per layout named after its YAML) adds the measured goodput and the prediction's error.")
    p.add_argument("workload", help="a 'pdserve bench' result JSON (its requests' arrivals, prompt and output lengths)")
    p.add_argument("configs", nargs="*", help="cluster YAMLs to compare (default configs/bench/*-small.yaml layouts)")
    p.add_argument("--cores", type=int, help="cores the layouts share (default this machine's)")
    p.add_argument("--slo-ttft", type=float, help="TTFT target, seconds (default the workload result's)")
    p.add_argument("--slo-tpot", type=float, help="TPOT target, seconds (default the workload result's)")
    p.add_argument("--costs", help="step costs saved by --save-costs: skip profiling")
    p.add_argument("--save-costs", help="write the profiled costs here")
    p.add_argument("--measured", help="directory of measured results of the same layouts, to compare")
    p.set_defaults(func=advise)


