"""Speculation on (adaptive, with its cost policy) vs off under Poisson arrivals, up to saturation.

    python benchmarks/spec_poisson.py --model builtin:code-small --rates 4,16,64 --num-requests 32 --threads 1

One process, two engines on the same model (prefix caching off): `off` (speculative.method none)
and `on` (--method, every other speculative setting the engine's default: adaptive k,
max_batch_tokens, max_batch_seqs, cost_policy). At each rate both serve the same requests with
the same seeded Poisson arrival times (loadgen.workloads.arrival_offsets), one after the other
(the order alternating from rate to rate): code-completion prompts cut from the stdlib files the
trained built-ins hold out (benchmarks/spec_decode.py), greedy, EOS ignored, --max-tokens each.
The loop adds each request when its arrival time has passed and steps the engine; a request's
TTFT and TPOT run from its arrival (time queued behind a step included), as loadgen defines them.
Per rate: output tokens/s (first arrival to last token), TPOT p50/p90/p99, TTFT p50/p99, the
on/off ratios, what was proposed and accepted, and whether the outputs are equal (greedy
speculation is exact: each of a verification's k + 1 rows is rounded as a one-row decode
rounds it, bf16 included; outputs can still part where a step's row count changes which kernel
runs a product, e.g. past kernels/packed_linear.py AMX_GEMM_ROWS on AMX). A rate beyond what
the engine serves is saturation: the queue grows and every step runs --max-num-seqs sequences.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
from spec_decode import generate, print_cost_policy, stdlib_prompts

from configs import EngineConfig
from engine import LLMEngine, SamplingParams
from loadgen.metrics import RequestRecord, Summary, summarize_run
from loadgen.workloads import arrival_offsets


def serve(engine: LLMEngine, prompts: list[list[int]], offsets: list[float],
          params: SamplingParams) -> tuple[Summary, list[list[int]]]:
    """Serves `prompts[i]` arriving `offsets[i]` s after the start; returns the run's summary and
    each request's tokens."""
    ids = [f"p{i}-{time.perf_counter_ns()}" for i in range(len(prompts))]
    times: dict[str, list[float]] = {rid: [] for rid in ids}
    outputs: dict[str, list[int]] = {}
    start = time.perf_counter()
    next_index = 0
    while next_index < len(ids) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while next_index < len(ids) and offsets[next_index] <= now:
            engine.add_request(ids[next_index], prompts[next_index], params)
            next_index += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, offsets[next_index] - now))
            continue
        outs = engine.step()
        stamp = time.perf_counter()
        for out in outs:
            times[out.request_id] += [stamp] * len(out.new_token_ids)  # a verified run arrives at once
            if out.finished:
                outputs[out.request_id] = out.token_ids
    records = [RequestRecord(start + offset, tuple(times[rid]), len(times[rid]), len(prompt))
               for rid, offset, prompt in zip(ids, offsets, prompts)]
    duration = max(r.token_times[-1] for r in records) - start
    return summarize_run(records, duration), [outputs[rid] for rid in ids]


def spec_counts(engine: LLMEngine) -> tuple[int, int]:
    proposed = sum(c.num_proposed for c in engine.speculator.totals.values())
    return proposed, sum(c.num_accepted for c in engine.speculator.totals.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:code-small")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--method", choices=("prompt_lookup", "draft", "prompt_lookup+draft"), default="prompt_lookup")
    parser.add_argument("--draft-model", default=None,
                        help="the draft for --method draft or prompt_lookup+draft (builtin:code-draft)")
    parser.add_argument("--draft-quantization", choices=("none", "int8"), default="none",
                        help="the draft's layers on int8 weights (speculative.draft_quantization)")
    parser.add_argument("--no-cost-policy", action="store_true", help="the `on` engine without speculative.cost_policy")
    parser.add_argument("--rates", default="4,16,64", help="requests/s, comma-separated")
    parser.add_argument("--num-requests", type=int, default=32, help="per rate and engine")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1 when other work shares the cores)")
    args = parser.parse_args()
    if args.method in ("draft", "prompt_lookup+draft") and not args.draft_model:
        parser.error(f"--method {args.method} needs --draft-model")
    if args.threads:
        torch.set_num_threads(args.threads)
    common = dict(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, enable_prefix_caching=False)
    speculative = {"method": args.method, "draft_model": args.draft_model, "cost_policy": not args.no_cost_policy,
                   "draft_quantization": args.draft_quantization}
    engines = {"off": LLMEngine(EngineConfig(**common)),
               "on": LLMEngine(EngineConfig(**common, speculative=speculative))}
    on_config = engines["on"].config.speculative
    dtype = next(engines["off"].model.parameters()).dtype
    print(f"model {args.model}, dtype {dtype}, {os.cpu_count()} CPUs, "
          f"torch threads {torch.get_num_threads()}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"on: {on_config.method} (k <= {on_config.num_tokens}, adaptive={on_config.adaptive}, "
          f"max_batch_tokens={on_config.max_batch_tokens}, max_batch_seqs={on_config.max_batch_seqs}, "
          f"cost_policy={on_config.cost_policy}); {args.num_requests} requests per rate, "
          f"{args.prompt_tokens}-token prompts, {args.max_tokens} tokens each, max_num_seqs {args.max_num_seqs}")
    pool = stdlib_prompts(engines["off"].encode, min(args.num_requests, 12), args.prompt_tokens, args.seed)
    prompts = [pool[i % len(pool)] for i in range(args.num_requests)]  # repeats cost the same: no prefix cache
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for engine in engines.values():  # warm-up
        generate(engine, prompts[:2], SamplingParams(max_tokens=8, ignore_eos=True))
    ok = True
    print(f"{'rate':>6} {'engine':>6} {'tok/s':>8} {'TPOT p50':>9} {'p90':>7} {'p99':>7} {'TTFT p50':>9} {'p99':>7}  "
          "(ms)   proposed/accepted")
    for index, rate in enumerate(float(r) for r in args.rates.split(",")):
        offsets = arrival_offsets(args.num_requests, rate, seed=args.seed + index)
        results: dict[str, Summary] = {}
        tokens: dict[str, list[list[int]]] = {}
        for name in ("off", "on") if index % 2 == 0 else ("on", "off"):
            before = spec_counts(engines[name])
            results[name], tokens[name] = serve(engines[name], prompts, offsets, params)
            after = spec_counts(engines[name])
            s = results[name]
            print(f"{rate:6g} {name:>6} {s.output_token_throughput:8.1f} {s.tpot['p50'] * 1e3:9.2f} "
                  f"{s.tpot['p90'] * 1e3:7.2f} {s.tpot['p99'] * 1e3:7.2f} {s.ttft['p50'] * 1e3:9.1f} "
                  f"{s.ttft['p99'] * 1e3:7.1f}        {after[0] - before[0]}/{after[1] - before[1]}")
        on, off = results["on"], results["off"]
        num_differ = sum(a != b for a, b in zip(tokens["on"], tokens["off"]))
        ok &= num_differ == 0
        print(f"{rate:6g}  on/off: tok/s {on.output_token_throughput / off.output_token_throughput:.3f}   TPOT "
              f"p50 {on.tpot['p50'] / off.tpot['p50']:.3f} p90 {on.tpot['p90'] / off.tpot['p90']:.3f} "
              f"p99 {on.tpot['p99'] / off.tpot['p99']:.3f}   outputs equal: "
              f"{'yes' if not num_differ else f'{num_differ} of {len(prompts)} requests differ'}")
    print_cost_policy(engines["on"], "  ")
    if not ok:
        # In float32 they never have (seen on builtin:tiny); in bf16 a verification's k + 1 rows
        # can round a near-tie otherwise than a one-row decode (seen with cost_policy off too).
        print(f"speculative outputs differ from plain greedy ({dtype}): exact only up to rounding in bf16")


if __name__ == "__main__":
    main()
