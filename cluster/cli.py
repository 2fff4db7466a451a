"""The `pdserve` command line.

    pdserve up configs/local.yaml                       # start a cluster, serve until Ctrl-C
    pdserve generate "def add(a, b):" --config configs/local.yaml   # ask its router
    pdserve down configs/local.yaml                     # stop it from another terminal
    pdserve complete "def add(a, b):" --max-tokens 32   # offline, in-process, no cluster
    pdserve model build builtin:tiny --out ./tiny       # write a checkpoint

    pdserve bench --address 127.0.0.1:50051 --workload mixed --rates 1,2   # load-test a router
    pdserve bench compare a.yaml b.yaml --workload mixed                 # each config in turn, ratios
    pdserve status configs/local.yaml                   # pools, workers, nodes, health, queues, KV
    pdserve scale configs/local.yaml --decode 2         # resize pools of a running cluster
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def _cmd_complete(args: argparse.Namespace) -> int:
    from configs import EngineConfig
    from engine import LLMEngine, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, ignore_eos=args.ignore_eos,
    )
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype))
    prompt_ids = engine.encode(args.prompt)
    engine.add_request("cli", prompt_ids, params)
    start = time.perf_counter()
    first_token_at = None
    shown = ""
    sys.stdout.write(args.prompt)
    while engine.has_unfinished_requests():
        for out in engine.step():
            first_token_at = first_token_at or time.perf_counter()
            # Re-decode the whole output each time: a multi-byte character split across tokens
            # only becomes printable once its last byte arrives.
            text = engine.decode(out.token_ids)
            if not text.endswith("\ufffd"):
                sys.stdout.write(text[len(shown):])
                sys.stdout.flush()
                shown = text
            if out.finished:
                sys.stdout.write(text[len(shown):] + "\n")
                elapsed = time.perf_counter() - start
                n = len(out.token_ids)
                print(
                    f"[{n} tokens, finish={out.finish_reason.value}, prompt {out.num_prompt_tokens} tokens, "
                    f"TTFT {1000 * (first_token_at - start):.1f} ms, {n / elapsed:.1f} tok/s]",
                    file=sys.stderr,
                )
    return 0


def _cmd_model_build(args: argparse.Namespace) -> int:
    from engine.model.builtin import build_builtin, parse_builtin

    name = parse_builtin(args.name)
    if name is None:
        raise SystemExit(f"pdserve: {args.name!r} is not a built-in model name (builtin:tiny, builtin:small)")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise SystemExit(f"pdserve: {args.out} exists and is not a directory")
    if os.path.exists(args.out) and os.listdir(args.out) and not args.force:
        raise SystemExit(f"pdserve: {args.out} exists and is not empty (use --force to overwrite)")
    out = build_builtin(name, args.out)
    print(f"wrote {args.name} to {out}")
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from cluster.lifecycle import Cluster
    from configs import load_cluster_config

    say = _say
    cluster = Cluster(load_cluster_config(args.config), args.config, timeout_s=args.timeout, say=say).start()
    try:
        say(f"pdserve: cluster up, gRPC at {cluster.grpc_address}; Ctrl-C or 'pdserve down {args.config}' stops it")
        cluster.serve_until_signal()
        say("pdserve: stopping the cluster ...")
    finally:
        cluster.shutdown()
    say("pdserve: stopped")
    return 0


def _say(line: str) -> None:
    print(line, flush=True)


def _cmd_down(args: argparse.Namespace) -> int:
    import signal

    from cluster import launcher
    from cluster.lifecycle import pid_alive

    state = launcher.read_state(args.config)
    if state is None or not pid_alive(state["pid"]):
        launcher.state_file(args.config).unlink(missing_ok=True)
        print(f"pdserve: no running cluster for {args.config}", file=sys.stderr)
        return 1
    os.kill(state["pid"], signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while pid_alive(state["pid"]):
        if time.monotonic() > deadline:
            print(f"pdserve: cluster (pid {state['pid']}) still stopping after {args.timeout:.0f} s", file=sys.stderr)
            return 1
        time.sleep(0.2)
    print("pdserve: cluster stopped")
    return 0


def _control(config_path: str, request: dict, timeout_s: float) -> dict:
    """One request to the `up` process of CONFIG's cluster; exits with the reason on failure."""
    from cluster import launcher
    from cluster.control import control_request
    from cluster.lifecycle import pid_alive
    from configs import load_cluster_config

    config = load_cluster_config(config_path)
    state = launcher.read_state(config_path)
    if state is None or not pid_alive(state["pid"]):
        raise SystemExit(f"pdserve: no running cluster for {config_path} (start it with 'pdserve up {config_path}')")
    host = config.router.host if config.router.host != "0.0.0.0" else "127.0.0.1"
    try:
        reply = control_request(f"{host}:{config.router.control_port}", request, timeout_s)
    except TimeoutError as exc:
        raise SystemExit(f"pdserve: {exc}") from None
    if not reply.get("ok"):
        raise SystemExit(f"pdserve: {reply.get('error')}")
    return reply


def _cmd_status(args: argparse.Namespace) -> int:
    import json

    status = _control(args.config, {"op": "status"}, args.timeout)["status"]
    if args.json:
        print(json.dumps(status, indent=1))
        return 0
    print(f"{status['mode']} cluster, gRPC {status['grpc_address']}, "
          f"{'ready' if status['ready'] else 'NOT READY'}, {status['requests_in_flight']} requests in flight")
    for node in status["nodes"]:
        resources = ", ".join(f"{k} {v:g}" for k, v in sorted(node["resources"].items())
                              if not k.startswith(("node:", "memory", "object_store")))
        print(f"  node {node['node_id'][:8]} {node['address']}: {resources}")
    for role, pool in status["pools"].items():
        print(f"  {role}: {pool['workers']} workers (target {pool['target']}, max {pool['max_workers']}), "
              f"TP={pool['tensor_parallel_size']} PP={pool['pipeline_parallel_size']}")
        if pool.get("autoscaling"):
            a = pool["autoscaling"]
            print(f"    autoscaler: wants {a['wanted']} ({a['why']})")
    print(f"  {'worker':<12} {'node':<10} {'health':<9} {'in flight':>9} {'running':>7} {'waiting':>7} "
          f"{'queued tok':>10} {'KV used/total':>14}  placement")
    for w in status["workers"]:
        health = "draining" if w.get("draining") else "healthy" if w.get("healthy") else "DOWN"
        pages = w.get("kv_pages") or {}
        kv = f"{pages.get('referenced', '?')}/{pages.get('num_pages', '?')}"
        placement = "-"
        if w.get("placement"):
            nodes = {n[:8] for n in w["placement"]["bundle_nodes"]}
            placement = f"{w['placement']['strategy']} x{len(w['placement']['bundles'])} on {', '.join(sorted(nodes))}"
        print(f"  {w['worker_id']:<12} {str(w.get('node_id', '?'))[:8]:<10} {health:<9} {w.get('in_flight', 0):>9} "
              f"{w.get('running', '?'):>7} {w.get('waiting', '?'):>7} {str(w.get('queued_tokens', '?')):>10} "
              f"{kv:>14}  {placement}" + (f"  error: {w['error']}" if w.get("error") else ""))
    return 0


def _cmd_scale(args: argparse.Namespace) -> int:
    sizes = {role: n for role, n in (("prefill", args.prefill), ("decode", args.decode),
                                     ("colocated", args.colocated)) if n is not None}
    if not sizes:
        raise SystemExit("pdserve: give at least one of --prefill N, --decode N, --colocated N")
    reply = _control(args.config, {"op": "scale", "sizes": sizes, "drain_timeout_s": args.drain_timeout},
                     args.drain_timeout * len(sizes) + args.timeout)
    for change in reply["changes"]:
        removed = [r["worker_id"] + (f" ({r['cut_off_requests']} requests cut off at the drain timeout)"
                                     if r["cut_off_requests"] else "") for r in change["removed"]]
        print(f"pdserve: {change['role']}: {change['size']} workers"
              + (f"; added {', '.join(change['added'])}" if change["added"] else "")
              + (f"; drained and removed {', '.join(removed)}" if removed else "")
              + ("" if change["added"] or removed else " (unchanged)"))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    """Up, one streamed request, down: the README's first command."""
    from cluster.lifecycle import Cluster
    from configs import load_cluster_config

    with Cluster(load_cluster_config(args.config), args.config, say=_say) as cluster:
        args.address, args.config = cluster.grpc_address, None
        _say(f"pdserve: sending {args.prompt!r} to the router at {cluster.grpc_address}\n")
        sys.stdout.write(args.prompt)
        code = _cmd_generate(args)
    _say("pdserve: cluster stopped")
    return code


def _cmd_generate(args: argparse.Namespace) -> int:
    import grpc

    from proto import pdserve_pb2 as pb
    from proto import pdserve_pb2_grpc

    address = args.address
    if address is None:
        from cluster import launcher
        from configs import load_cluster_config

        if args.config is None:
            raise SystemExit("pdserve: give --config CONFIG.yaml (of a cluster started with 'pdserve up') or --address")
        state = launcher.read_state(args.config)
        cfg = load_cluster_config(args.config)
        address = state["grpc_address"] if state else f"{cfg.router.host}:{cfg.router.grpc_port}"
    sampling = pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                 top_p=args.top_p, ignore_eos=args.ignore_eos, stop=args.stop or [])
    if args.seed is not None:
        sampling.seed = args.seed
    with grpc.insecure_channel(address) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        try:
            for resp in stub.Generate(pb.GenerateRequest(text=args.prompt, sampling=sampling), timeout=args.timeout):
                sys.stdout.write(resp.text)
                sys.stdout.flush()
                last = resp
        except grpc.RpcError as exc:
            print(f"\npdserve: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    u = last.usage
    print(f"\n[{u.completion_tokens} tokens, finish={pb.FinishReason.Name(last.finish_reason)}, "
          f"prompt {u.prompt_tokens} tokens ({u.cached_prompt_tokens} cached), TTFT {1000 * u.ttft_s:.1f} ms]",
          file=sys.stderr)
    return 0


def _bench_plan(args: argparse.Namespace):
    """The BenchPlan the workload flags describe (shared by `bench` and `bench compare`)."""
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
                     args.warmup)


def _cmd_bench(args: argparse.Namespace) -> int:
    from loadgen import plot_if_available
    from loadgen.results import write_result
    from loadgen.runner import run_bench

    if args.address is None:
        raise SystemExit("pdserve: bench needs --address (gRPC HOST:PORT, or the HTTP base URL with --backend openai)")
    plan = _bench_plan(args)
    label = args.label or args.workload
    result = run_bench(args.backend, args.address, plan, label, model=args.model, progress=not args.no_progress)
    out = Path(args.out)
    paths = [*write_result(result, out)] + ([] if args.no_plots else plot_if_available([result], out, prefix=f"{label}-"))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if all(r.ok for run in result.runs for r in run.records) else 1


def _cmd_bench_plot(args: argparse.Namespace) -> int:
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


def _cmd_bench_compare(args: argparse.Namespace) -> int:
    from cluster.bench_compare import run_compare
    from cluster.lifecycle import refuse_if_up

    for config in args.configs:  # its ports are taken: refuse before starting anything
        refuse_if_up(config)
    results = run_compare([Path(c) for c in args.configs], _bench_plan(args), args.backend, Path(args.out),
                          timeout_s=args.timeout, progress=not args.no_progress,
                          say=lambda line: print(line, flush=True))
    return 0 if all(r.ok for res in results for run in res.runs for r in run.records) else 1


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="pdserve: disaggregated prefill/decode LLM serving. Models are 'builtin:tiny', "
        "'builtin:small' (made locally on first use) or a local Hugging Face directory "
        "(Llama, Mistral or Qwen2 family, safetensors weights).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    complete = sub.add_parser("complete", help="generate a completion in-process with the engine (no cluster)")
    complete.add_argument("prompt", help="prompt text")
    complete.add_argument("--model", default="builtin:tiny", help="model name or directory (default: builtin:tiny)")
    _sampling_args(complete, served=False)
    complete.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                          help="auto: bfloat16 where the CPU has native bf16 (or on GPU), else float32")
    complete.set_defaults(func=_cmd_complete)

    up = sub.add_parser("up", help="start a cluster from a YAML config and serve until Ctrl-C")
    up.add_argument("config", help="cluster YAML (see configs/local.yaml)")
    up.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for every worker (default 300)")
    up.set_defaults(func=_cmd_up)

    down = sub.add_parser("down", help="stop the cluster that 'pdserve up CONFIG' started")
    down.add_argument("config", help="the same YAML given to 'pdserve up'")
    down.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for it to stop (default 60)")
    down.set_defaults(func=_cmd_down)

    st = sub.add_parser("status", help="pools and workers of a running cluster: nodes, placement, health, queues, KV")
    st.add_argument("config", help="the YAML given to 'pdserve up'")
    st.add_argument("--json", action="store_true", help="the whole report as JSON")
    st.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for an answer (default 30)")
    st.set_defaults(func=_cmd_status)
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
    sc.set_defaults(func=_cmd_scale)
    gen = sub.add_parser("generate", help="send one prompt to a running cluster's router and stream the reply")
    gen.add_argument("prompt", help="prompt text")
    where = gen.add_mutually_exclusive_group()
    where.add_argument("--config", help="YAML of a cluster started with 'pdserve up'")
    where.add_argument("--address", help="router gRPC address HOST:PORT")
    _sampling_args(gen)
    gen.set_defaults(func=_cmd_generate)

    demo = sub.add_parser("demo", help="start a cluster, stream one completion through it, stop it")
    demo.add_argument("config", help="cluster YAML (e.g. configs/local.yaml)")
    demo.add_argument("prompt", nargs="?", default="def fibonacci(n):", help="prompt text")
    _sampling_args(demo)
    demo.set_defaults(func=_cmd_demo)

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
    b.set_defaults(func=_cmd_bench)
    bench_sub = b.add_subparsers(dest="bench_command", metavar="{plot,compare}")
    plot = bench_sub.add_parser("plot", help="overlay the plots of saved results (one line per --label)")
    plot.add_argument("results", nargs="+", help="RESULT.json files written by 'pdserve bench'")
    plot.add_argument("--out", default="bench-plots", help="directory for the PNGs (default bench-plots)")
    plot.set_defaults(func=_cmd_bench_plot)
    compare = bench_sub.add_parser(
        "compare", help="run one workload against several cluster configs in turn and print ratios",
        description="For each CONFIG.yaml in turn: start the cluster (as 'pdserve up'), run the workload at "
        "each rate, stop it. Writes each result (labelled by the config's file name), overlay plots and "
        "compare.md: a table with ratios against the first config.")
    compare.add_argument("configs", nargs="+", metavar="CONFIG.yaml", help="cluster configs; the first is the baseline")
    _bench_workload_args(compare, default_out="bench-compare")
    compare.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each cluster (default 300)")
    compare.set_defaults(func=_cmd_bench_compare)

    model = sub.add_parser("model", help="manage checkpoints")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    build = model_sub.add_parser("build", help="write a built-in model in Hugging Face format to a directory")
    build.add_argument("name", help="builtin:tiny or builtin:small")
    build.add_argument("--out", required=True, help="directory to write (config.json, model.safetensors, tokenizer.json)")
    build.add_argument("--force", action="store_true", help="write into a non-empty directory")
    build.set_defaults(func=_cmd_model_build)
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
