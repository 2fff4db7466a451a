"""`pdserve bench`, `bench plot` and `bench compare`: the load generator (loadgen/) against one
server, its charts, and several cluster configs in turn (cluster/bench_compare.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def bench_plan(args: argparse.Namespace):
    """The BenchPlan the workload flags describe (shared by `bench` and `bench compare`)."""
    from loadgen.client import RequestOptions
    from loadgen.metrics import SLO
    from loadgen.runner import BenchPlan
    from loadgen.workloads import LengthDist, WorkloadSpec

    spec = WorkloadSpec(
        args.workload, args.num_prompts,
        LengthDist(args.input_len, args.input_dist, args.input_range_ratio),
        LengthDist(args.output_len, args.output_dist, args.output_range_ratio),
        vocab_size=args.vocab_size, seed=args.seed, long_fraction=args.long_fraction, long_factor=args.long_factor,
        num_prefixes=args.num_prefixes, suffix_len=args.suffix_len)
    rates = tuple(args.rates) if args.rates else (args.rate,) if args.rate is not None else (float("inf"),)
    return BenchPlan(spec, rates, args.burstiness, args.max_concurrency, SLO(args.slo_ttft, args.slo_tpot),
                     args.warmup, RequestOptions(args.speculative_method, args.num_speculative_tokens))


def bench(args: argparse.Namespace) -> int:
    from cluster.client_auth import client_auth
    from loadgen import plot_if_available
    from loadgen.results import write_result
    from loadgen.runner import run_bench

    if args.address is None:
        raise SystemExit("pdserve: bench needs --address (gRPC HOST:PORT, or the HTTP base URL with --backend openai)")
    plan = bench_plan(args)
    label = args.label or args.workload
    result = run_bench(args.backend, args.address, plan, label, model=args.model, progress=not args.no_progress,
                       auth=client_auth(args))
    out = Path(args.out)
    paths = [*write_result(result, out)] + ([] if args.no_plots else plot_if_available([result], out, prefix=f"{label}-"))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if all(r.ok for run in result.runs for r in run.records) else 1


def bench_plot(args: argparse.Namespace) -> int:
    from loadgen.results import load_result

    try:
        from loadgen.plots import plot_results
    except ImportError:
        raise SystemExit("pdserve: bench plot needs matplotlib: pip install 'pdserve[plots]'") from None

    results = [load_result(p) for p in args.results]
    labels = [r.label for r in results]
    if len(set(labels)) != len(labels):
        print(f"pdserve: warning: results share labels {labels}; give each run its own --label", file=sys.stderr)
    paths = plot_results(results, Path(args.out))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def bench_compare(args: argparse.Namespace) -> int:
    from cluster.bench_compare import run_compare
    from cluster.client_auth import client_auth
    from cluster.lifecycle import refuse_if_up

    for config in args.configs:  # its ports are taken: refuse before starting anything
        refuse_if_up(config)
    results = run_compare([Path(c) for c in args.configs], bench_plan(args), args.backend, Path(args.out),
                          timeout_s=args.timeout, progress=not args.no_progress,
                          say=lambda line: print(line, flush=True), auth_for=lambda cfg: client_auth(args, cfg))
    return 0 if all(r.ok for res in results for run in res.runs for r in run.records) else 1
