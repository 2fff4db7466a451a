"""The `pdserve` command line.

    pdserve up configs/local.yaml                       # start a cluster, serve until Ctrl-C
    pdserve generate "def add(a, b):" --config configs/local.yaml   # ask its router
    pdserve down configs/local.yaml                     # stop it from another terminal
    pdserve complete "def add(a, b):" --max-tokens 32   # offline, in-process, no cluster
    pdserve model build builtin:tiny --out ./tiny       # write a checkpoint
    pdserve model train --out ./code-small              # train a small code model (~12 min on 2 cores)
    pdserve model distill --out ./code-draft            # distil a draft from builtin:code-small

    pdserve bench --address 127.0.0.1:50051 --workload mixed --rates 1,2   # load-test a router
    pdserve bench compare a.yaml b.yaml --workload mixed                 # each config in turn, ratios
    pdserve status configs/local.yaml                   # pools, workers, nodes, health, queues, KV
    pdserve scale configs/local.yaml --decode 2         # resize pools of a running cluster
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from cluster import cmd_advise, cmd_bench, cmd_cluster, cmd_debug, cmd_model, cmd_requests
from cluster.client_auth import add_client_auth_args


def _sampling_args(parser: argparse.ArgumentParser, served: bool = True) -> None:
    """Sampling flags; `served` adds those only the router applies (stop strings, deadline)."""
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens to generate at most (default 48)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default 1)")
    parser.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    if served:
        parser.add_argument("--stop", action="append", help="stop string (repeatable)")
        parser.add_argument("--timeout", type=float, default=120.0, help="request deadline in seconds (default 120)")


def _speculative_args(parser: argparse.ArgumentParser) -> None:
    """Per-request speculative decoding (gRPC SamplingParams fields; OpenAI extension fields)."""
    from configs.engine import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS

    g = parser.add_argument_group("speculative decoding (per request; default: the serving pool's setting)")
    g.add_argument("--speculative-method", choices=SPECULATIVE_METHODS, default=None,
                   help="none: off; prompt_lookup: n-gram proposals from the prompt and output; draft: the "
                   "pool's draft model proposes; medusa: the pool's Medusa heads propose; prompt_lookup+draft: prompt "
                   "lookup where it finds a match, the draft where it finds none (draft, medusa and "
                   "prompt_lookup+draft: no speculation where the pool has no draft / heads)")
    g.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   choices=range(MAX_SPECULATIVE_TOKENS + 1),
                   help=f"proposed tokens per step at most, 0-{MAX_SPECULATIVE_TOKENS} (0: off)")


def _rate_list(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates like 1,2,4 (or inf), got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be > 0, got {text!r}")
    return rates


def _bench_workload_args(parser: argparse.ArgumentParser, default_out: str) -> None:
    """What to send and how: the same flags for `bench` and `bench compare`."""
    from loadgen.workloads import LENGTH_DISTS, WORKLOADS

    parser.add_argument("--backend", choices=["grpc", "openai"], default="grpc",
                        help="grpc: pdserve's router; openai: any server's streaming /v1/completions (default grpc)")
    add_client_auth_args(parser)
    w = parser.add_argument_group("workload (seeded: the same flags send the same tokens at the same times)")
    w.add_argument("--workload", default="fixed", choices=WORKLOADS,
                   help="fixed: lengths from the distributions; mixed: short prompts plus a --long-fraction of "
                   "--long-factor times longer ones; prefix: --num-prefixes shared prefixes + unique suffixes; "
                   "throughput: fixed-shaped burst (see --max-concurrency); sweep: fixed-shaped at each of --rates")
    w.add_argument("--num-prompts", type=int, default=32, help="requests per rate (default 32)")
    w.add_argument("--input-len", type=int, default=128, help="mean prompt tokens (prefix: the shared prefix's)")
    w.add_argument("--input-dist", choices=LENGTH_DISTS, default="fixed",
                   help="fixed; uniform in len*(1 -/+ ratio); exponential with that mean, clipped at 4x (default fixed)")
    w.add_argument("--input-range-ratio", type=float, default=0.0, help="uniform's half-width as a fraction of the mean")
    w.add_argument("--output-len", type=int, default=32, help="mean generated tokens (exact: ignore_eos)")
    w.add_argument("--output-dist", choices=LENGTH_DISTS, default="fixed", help="as --input-dist")
    w.add_argument("--output-range-ratio", type=float, default=0.0, help="as --input-range-ratio")
    w.add_argument("--long-fraction", type=float, default=0.1, help="mixed: share of long prompts (default 0.1)")
    w.add_argument("--long-factor", type=int, default=8, help="mixed: long prompt = this x --input-len (default 8)")
    w.add_argument("--num-prefixes", type=int, default=4, help="prefix: shared prefixes; 0 = no-sharing control")
    w.add_argument("--suffix-len", type=int, default=16, help="prefix: unique tokens after the prefix (default 16)")
    w.add_argument("--vocab-size", type=int, default=4096, help="token ids are drawn from [3, this) (default 4096)")
    w.add_argument("--seed", type=int, default=0)
    a = parser.add_argument_group("arrivals")
    rate = a.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=float, default=None, help="requests/s, Poisson (default: a burst)")
    rate.add_argument("--rates", type=_rate_list, help="several rates, one run each: 1,2,4 (sweep needs these)")
    a.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival gaps: 1 = Poisson, < 1 burstier, > 1 steadier (default 1)")
    a.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no cap)")
    a.add_argument("--warmup", type=int, default=1, help="unmeasured requests sent first (default 1)")
    m = parser.add_argument_group("SLO and output")
    m.add_argument("--slo-ttft", type=float, default=None, help="TTFT target in seconds (goodput, attainment)")
    m.add_argument("--slo-tpot", type=float, default=None, help="TPOT target in seconds (goodput, attainment)")
    m.add_argument("--out", default=default_out, help=f"directory for results and plots (default {default_out})")
    m.add_argument("--no-progress", action="store_true", help="no progress bar")
    _speculative_args(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="pdserve: disaggregated prefill/decode LLM serving. Models are 'builtin:tiny', "
        "'builtin:small' (random, made locally on first use), 'builtin:code-small', 'builtin:code-draft' "
        "(trained locally on first use) or a local Hugging Face directory (Llama, Mistral or Qwen2 family, "
        "safetensors weights); 'builtin:code-medusa' names Medusa heads for builtin:code-small.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    complete = sub.add_parser("complete", help="generate a completion in-process with the engine (no cluster)")
    complete.add_argument("prompt", help="prompt text")
    complete.add_argument("--model", default="builtin:tiny", help="model name or directory (default: builtin:tiny)")
    _sampling_args(complete, served=False)
    _speculative_args(complete)
    complete.add_argument("--draft-model", default=None,
                          help="load this draft model (a directory or builtin: name with the model's tokenizer) and "
                          "speculate with it unless --speculative-method says otherwise")
    complete.add_argument("--medusa-heads", default=None,
                          help="load these Medusa heads (a directory in Medusa's layout, made for the model, or "
                          "builtin:code-medusa for builtin:code-small) and speculate with them unless "
                          "--speculative-method says otherwise")
    complete.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                          help="auto: bfloat16 where the CPU has native bf16 (or on GPU), else float32")
    complete.set_defaults(func=cmd_requests.complete)

    up = sub.add_parser("up", help="start a cluster from a YAML config and serve until Ctrl-C")
    up.add_argument("config", help="cluster YAML (see configs/local.yaml)")
    up.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for every worker (default 300)")
    up.add_argument("--dry-run", action="store_true",
                    help="build and print every worker's spec (ports, engine, KV transport, Ray bundles) and the "
                    "router's, then exit: no Ray, no model, no GPU needed")
    up.set_defaults(func=cmd_cluster.up)

    down = sub.add_parser("down", help="stop the cluster that 'pdserve up CONFIG' started")
    down.add_argument("config", help="the same YAML given to 'pdserve up'")
    down.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for it to stop (default 60)")
    down.set_defaults(func=cmd_cluster.down)

    st = sub.add_parser("status", help="pools and workers of a running cluster: nodes, placement, health, queues, KV")
    st.add_argument("config", help="the YAML given to 'pdserve up'")
    st.add_argument("--json", action="store_true", help="the whole report as JSON")
    st.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for an answer (default 30)")
    st.set_defaults(func=cmd_cluster.status)
    sc = sub.add_parser(
        "scale", help="resize pools of a running cluster",
        description="Resize pools of the cluster 'pdserve up CONFIG' runs. New workers take traffic once healthy; "
        "removed ones are drained first (no new requests; those in flight finish, up to --drain-timeout). "
        "A pool may grow up to its max_workers (config), whose ports are reserved.")
    sc.add_argument("config", help="the YAML given to 'pdserve up'")
    sc.add_argument("--prefill", type=int, help="prefill workers wanted")
    sc.add_argument("--decode", type=int, help="decode workers wanted")
    sc.add_argument("--colocated", type=int, help="colocated workers wanted")
    sc.add_argument("--drain-timeout", type=float, default=60.0,
                    help="seconds a removed worker's requests may take to finish (default 60)")
    sc.add_argument("--timeout", type=float, default=300.0, help="seconds new workers may take to start (default 300)")
    sc.set_defaults(func=cmd_cluster.scale)
    ro = sub.add_parser(
        "role", help="flip a worker of a running cluster between prefill and decode",
        description="Flip a worker of the cluster 'pdserve up CONFIG' runs between prefill and decode, with no restart "
        "(router.role_switching.mode manual or auto). The router routes the new role's work to it at once; what it "
        "holds of the old role finishes there. Its pool, and so 'pdserve scale', stay as they were.")
    ro.add_argument("config", help="the YAML given to 'pdserve up'")
    ro.add_argument("worker", help="the worker's id, as 'pdserve status' lists it (e.g. decode-1)")
    ro.add_argument("new_role", choices=["prefill", "decode"], help="the role it serves from now on")
    ro.add_argument("--reason", default="asked by pdserve role", help="kept with the flip, shown by 'pdserve status'")
    ro.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for an answer (default 30)")
    ro.set_defaults(func=cmd_cluster.role)
    gen = sub.add_parser("generate", help="send one prompt to a running cluster's router and stream the reply")
    gen.add_argument("prompt", help="prompt text")
    where = gen.add_mutually_exclusive_group()
    where.add_argument("--config", help="YAML of a cluster started with 'pdserve up'")
    where.add_argument("--address", help="router gRPC address HOST:PORT")
    _sampling_args(gen)
    _speculative_args(gen)
    add_client_auth_args(gen)
    gen.set_defaults(func=cmd_requests.generate)

    demo = sub.add_parser("demo", help="start a cluster, stream one completion through it, stop it")
    demo.add_argument("config", help="cluster YAML (e.g. configs/local.yaml)")
    demo.add_argument("prompt", nargs="?", default="def fibonacci(n):", help="prompt text")
    _sampling_args(demo)
    _speculative_args(demo)
    add_client_auth_args(demo)
    demo.set_defaults(func=cmd_requests.demo)

    b = sub.add_parser(
        "bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="load-test a running server (gRPC or OpenAI HTTP); 'bench plot', 'bench compare'",
        description="Drive a running server with a seeded workload; report TTFT/TPOT/ITL/E2E percentiles, "
        "throughput, goodput and SLO attainment; write JSON, CSV and PNG plots.",
        epilog="""examples:
  pdserve bench --address 127.0.0.1:50051 --workload mixed --rate 2 --slo-ttft 1 --slo-tpot 0.1
  pdserve bench --backend openai --address http://127.0.0.1:8000 --workload sweep --rates 1,2,4
  pdserve bench --address 127.0.0.1:50051 --workload throughput --max-concurrency 16
  pdserve bench plot results/a.json results/b.json --out plots
  pdserve bench compare configs/bench/colocated-small.yaml configs/bench/disagg-small.yaml --workload mixed""")
    b.add_argument("--address", help="gRPC HOST:PORT, or with --backend openai the base URL (http://HOST:PORT)")
    _bench_workload_args(b, default_out="bench-results")
    b.add_argument("--model", help="--backend openai: model name to request (default: the server's first)")
    b.add_argument("--label", help="names this system/config in the files and on plots (default: the workload)")
    b.add_argument("--no-plots", action="store_true", help="write JSON and CSV only")
    b.set_defaults(func=cmd_bench.bench)
    bench_sub = b.add_subparsers(dest="bench_command", metavar="{plot,compare}")
    plot = bench_sub.add_parser("plot", help="overlay the plots of saved results (one line per --label)")
    plot.add_argument("results", nargs="+", help="RESULT.json files written by 'pdserve bench'")
    plot.add_argument("--out", default="bench-plots", help="directory for the PNGs (default bench-plots)")
    plot.set_defaults(func=cmd_bench.bench_plot)
    compare = bench_sub.add_parser(
        "compare", help="run one workload against several cluster configs in turn and print ratios",
        description="For each CONFIG.yaml in turn: start the cluster (as 'pdserve up'), run the workload at "
        "each rate, stop it. Writes each result (labelled by the config's file name), overlay plots and "
        "compare.md: a table with ratios against the first config.")
    compare.add_argument("configs", nargs="+", metavar="CONFIG.yaml", help="cluster configs; the first is the baseline")
    _bench_workload_args(compare, default_out="bench-compare")
    compare.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each cluster (default 300)")
    compare.set_defaults(func=cmd_bench.bench_compare)

    cmd_model.add_model_commands(sub)
    cmd_debug.add_debug_commands(sub)
    cmd_advise.add_advise_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, TimeoutError, RuntimeError) as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
