"""Speculative decoding benchmark: tokens/s with each method vs without, measured side by side.

    python benchmarks/spec_decode.py                                # builtin:tiny, quick
    python benchmarks/spec_decode.py --model builtin:code-small --num-prompts 8 --max-tokens 128

Workload: code-completion prompts cut from this Python's standard library sources (files
chosen with --seed, each prompt the first --prompt-tokens tokens of a file that has them),
greedy, EOS ignored so every run emits the same number of tokens.

1. Concurrency 1: each prompt alone, once per method (interleaved: none, prompt_lookup, none,
   ...), on one engine whose requests choose the method (SamplingParams.speculative_method), so
   every method runs on the same weights and threads. Prints per-method decode tokens/s
   (p50/p90 over prompts and the aggregate), the ratio to `none`, the acceptance rate and the mean
   accepted length (tokens emitted per verifying step, the target's own included), and checks
   that every method's tokens equal `none`'s (greedy speculation is exact).
2. Saturation: --batch-size prompts at once (continuous batching), speculation on (the engine's
   adaptive default, with its max_batch_tokens) vs off, --repeats times alternately; prints the
   best tokens/s of each and the ratio (a value below 0.95 would be a regression to report).

A random built-in model's acceptance rates mean nothing (it never repeats itself); read numbers
only from a trained model.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from configs import EngineConfig
from engine import LLMEngine, SamplingParams

METHODS = ("none", "prompt_lookup")


def stdlib_prompts(engine: LLMEngine, n: int, num_tokens: int, seed: int) -> list[list[int]]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    random.Random(seed).shuffle(files)
    prompts = []
    for path in files:
        ids = engine.encode(path.read_text(errors="replace"))
        if len(ids) >= num_tokens:
            prompts.append(ids[:num_tokens])
        if len(prompts) == n:
            break
    return prompts


def generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, dict[str, list[int]]]:
    """Runs the prompts to completion together; returns the wall time and each one's tokens."""
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{i}-{time.perf_counter_ns()}", prompt, params)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
    return time.perf_counter() - start, outputs


def concurrency_one(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> None:
    rates: dict[str, list[float]] = {m: [] for m in METHODS}
    times = {m: 0.0 for m in METHODS}
    tokens: dict[str, list[list[int]]] = {m: [] for m in METHODS}
    before = {m: (c.num_proposed, c.num_accepted, c.num_verified) for m, c in engine.speculator.totals.items()}
    for prompt in prompts:
        for method in METHODS:
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, speculative_method=method)
            seconds, outs = generate(engine, [prompt], params)
            [out] = outs.values()
            rates[method].append(len(out) / seconds)
            times[method] += seconds
            tokens[method].append(out)
    base = len(prompts) * max_tokens / times["none"]
    print(f"concurrency 1: {len(prompts)} prompts x {max_tokens} tokens")
    for method in METHODS:
        agg = len(prompts) * max_tokens / times[method]
        q = statistics.quantiles(rates[method], n=10) if len(rates[method]) > 1 else rates[method] * 9
        line = (f"  {method:14s} {agg:8.1f} tok/s  (per prompt p50={statistics.median(rates[method]):.1f} "
                f"p90={q[8]:.1f})  ratio vs none = {agg / base:.2f}")
        total = engine.speculator.totals.get(method)
        if total is not None:
            p0, a0, v0 = before.get(method, (0, 0, 0))
            proposed, accepted, verified = total.num_proposed - p0, total.num_accepted - a0, total.num_verified - v0
            if verified:
                line += (f"  acceptance rate {accepted / max(1, proposed):.2f}  mean accepted length "
                         f"{(accepted + verified) / verified:.2f}  ({proposed} proposed in {verified} verifications)")
        print(line)
        same = tokens[method] == tokens["none"]
        if not same:
            print(f"  !! {method}: tokens differ from none (greedy speculation must be exact)")


def saturation(model: str, dtype: str, prompts: list[list[int]], max_tokens: int, repeats: int,
               speculative: dict) -> None:
    engines = {"off": LLMEngine(EngineConfig(model=model, dtype=dtype, max_num_seqs=len(prompts))),
               "on": LLMEngine(EngineConfig(model=model, dtype=dtype, max_num_seqs=len(prompts),
                                            speculative=speculative))}
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    best = {name: float("inf") for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            seconds, _ = generate(engine, prompts, params)
            best[name] = min(best[name], seconds)
    total = len(prompts) * max_tokens
    on = engines["on"].speculator.totals.get(speculative["method"])
    print(f"saturation: {len(prompts)} sequences x {max_tokens} tokens, best of {repeats}")
    print(f"  off {total / best['off']:8.1f} tok/s   on (adaptive, max_batch_tokens="
          f"{engines['on'].config.speculative.max_batch_tokens}) {total / best['on']:8.1f} tok/s   "
          f"ratio on/off = {best['off'] / best['on']:.3f}   proposed {on.num_proposed if on else 0}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32, help="saturation check: sequences at once (0: skip)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    speculative = {"method": "prompt_lookup", "num_tokens": args.num_speculative_tokens}
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, speculative=speculative))
    print(f"model {args.model}, dtype {next(engine.model.parameters()).dtype}, "
          f"{os.cpu_count()} CPUs, torch threads {__import__('torch').get_num_threads()}")
    prompts = stdlib_prompts(engine, max(args.num_prompts, args.batch_size), args.prompt_tokens, args.seed)
    generate(engine, prompts[:1], SamplingParams(max_tokens=4))  # warm-up
    concurrency_one(engine, prompts[: args.num_prompts], args.max_tokens)
    if args.batch_size:
        batch = (prompts * (args.batch_size // len(prompts) + 1))[: args.batch_size]
        saturation(args.model, args.dtype, batch, args.max_tokens, args.repeats, speculative)


if __name__ == "__main__":
    main()
