"""The `pdserve` command line.

    pdserve up configs/local.yaml                       # start a cluster, serve until Ctrl-C
    pdserve generate "def add(a, b):" --config configs/local.yaml   # ask its router
    pdserve down configs/local.yaml                     # stop it from another terminal
    pdserve complete "def add(a, b):" --max-tokens 32   # offline, in-process, no cluster
    pdserve model build builtin:tiny --out ./tiny       # write a checkpoint

Sub-commands arrive with their issues (`scale`, `status`, `bench`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def _cmd_complete(args: argparse.Namespace) -> int:
    from engine import LLMEngine, SamplingParams
    from configs import EngineConfig

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
    from engine.builtin_models import build_builtin, parse_builtin

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
    import signal

    from cluster import launcher
    from configs import load_cluster_config

    config = load_cluster_config(args.config)
    existing = launcher.read_state(args.config)
    if existing and _pid_alive(existing["pid"]):
        raise SystemExit(f"pdserve: a cluster for {args.config} is already up (pid {existing['pid']}); "
                         f"run 'pdserve down {args.config}' first")
    cluster = launcher.up(config, timeout_s=args.timeout, say=lambda line: print(line, flush=True))
    state = launcher.write_state(args.config, cluster)
    # SIGTERM (what `pdserve down` sends) ends the cluster like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    print(f"pdserve: cluster up, gRPC at {cluster.grpc_address}; Ctrl-C or 'pdserve down {args.config}' stops it",
          flush=True)
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        print("pdserve: stopping the cluster ...", flush=True)
    finally:
        cluster.shutdown()
        state.unlink(missing_ok=True)
    print("pdserve: stopped", flush=True)
    return 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:  # an exited child its parent has not reaped yet (a zombie) has stopped too
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def _cmd_down(args: argparse.Namespace) -> int:
    import signal

    from cluster import launcher

    state = launcher.read_state(args.config)
    if state is None or not _pid_alive(state["pid"]):
        launcher.state_file(args.config).unlink(missing_ok=True)
        print(f"pdserve: no running cluster for {args.config}", file=sys.stderr)
        return 1
    os.kill(state["pid"], signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while _pid_alive(state["pid"]):
        if time.monotonic() > deadline:
            print(f"pdserve: cluster (pid {state['pid']}) still stopping after {args.timeout:.0f} s", file=sys.stderr)
            return 1
        time.sleep(0.2)
    print("pdserve: cluster stopped")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    """Up, one streamed request, down: the README's first command."""
    from cluster import launcher
    from configs import load_cluster_config

    cluster = launcher.up(load_cluster_config(args.config), say=lambda line: print(line, flush=True))
    try:
        args.address, args.config = cluster.grpc_address, None
        print(f"pdserve: sending {args.prompt!r} to the router at {cluster.grpc_address}\n", flush=True)
        sys.stdout.write(args.prompt)
        return _cmd_generate(args)
    finally:
        cluster.shutdown()
        print("pdserve: cluster stopped", flush=True)


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


def _cmd_bench(args: argparse.Namespace) -> int:
    from cluster.bench import bench
    from cluster.bench_metrics import SLO

    summary = bench(args.address, args.workload, args.num_prompts, args.input_len, args.output_len, args.rate,
                    args.seed, args.vocab_size, Path(args.out), SLO(args.slo_ttft, args.slo_tpot))
    return 0 if summary.num_failed == 0 else 1


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
    complete.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    complete.set_defaults(func=_cmd_complete)

    up = sub.add_parser("up", help="start a cluster from a YAML config and serve until Ctrl-C")
    up.add_argument("config", help="cluster YAML (see configs/local.yaml)")
    up.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for every worker (default 300)")
    up.set_defaults(func=_cmd_up)

    down = sub.add_parser("down", help="stop the cluster that 'pdserve up CONFIG' started")
    down.add_argument("config", help="the same YAML given to 'pdserve up'")
    down.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for it to stop (default 60)")
    down.set_defaults(func=_cmd_down)

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

    b = sub.add_parser("bench", help="drive a running router with a seeded workload and report TTFT/TPOT/ITL/goodput")
    b.add_argument("--address", required=True, help="router gRPC address HOST:PORT")
    b.add_argument("--workload", default="fixed", choices=["fixed", "mixed", "prefix"])
    b.add_argument("--num-prompts", type=int, default=32)
    b.add_argument("--input-len", type=int, default=128, help="prompt tokens (mixed: long ones are 8x)")
    b.add_argument("--output-len", type=int, default=32, help="generated tokens per request (ignore_eos)")
    b.add_argument("--rate", type=float, default=float("inf"), help="Poisson requests/s (default: a burst)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--vocab-size", type=int, default=4096, help="token ids are drawn below this")
    b.add_argument("--slo-ttft", type=float, default=None, help="TTFT target in seconds (for goodput)")
    b.add_argument("--slo-tpot", type=float, default=None, help="TPOT target in seconds (for goodput)")
    b.add_argument("--out", default="bench-results", help="directory for the JSON and CSV results")
    b.set_defaults(func=_cmd_bench)

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
