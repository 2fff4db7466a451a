"""Engine microbenchmark (`make bench`): decode step time against its roofline floor, prefill
against the measured matmul peak, on the engine's CPU kernels and on the torch fallback path,
side by side in one run.

    python benchmarks/engine_steps.py                        # builtin:small, dtype auto
    python benchmarks/engine_steps.py --batches 1,16,64 --context 512 --backends auto,torch

Decode at batch B (every sequence at --context tokens): the step's floor is the larger of
    memory: (weight bytes + B x context x KV bytes per token) / streaming read bandwidth
    compute: 2 x matmul params x B / matmul peak
with both peaks measured here first (a 1 GiB sum; the best of several 2048^2 matmuls in the
engine's dtype). Prefill: one --prefill-len prompt per step; tokens/s and MFU = prefill FLOPs
(engine/metrics/roofline.py) / step time / matmul peak. Prints p50/p90/p99 of the step times.
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

from configs import EngineConfig
from engine import LLMEngine, SamplingParams
from engine.metrics.peak import measure_read_bandwidth
from engine.metrics.roofline import ModelCost
from engine.metrics.step_stats import StepWork
from loadgen.metrics import summarize


def matmul_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    return 2 * size**3 / min(_timed(lambda: a @ b) for _ in range(repeats))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def prompt(i: int, n: int, vocab: int) -> list[int]:
    return [0] + [(i * 7919 + j * 104729) % (vocab - 3) + 3 for j in range(n - 1)]


def decode_steps(engine: LLMEngine, batch: int, context: int, steps: int) -> list[float]:
    """Step times of `steps` decode steps of `batch` sequences at ~`context` tokens."""
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        engine.add_request(f"d{batch}-{i}", prompt(i, context, vocab), SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()  # prefill, unmeasured
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times[:-1] or times  # the last step finishes every sequence at once


def prefill_steps(engine: LLMEngine, length: int, repeats: int) -> list[float]:
    times = []
    vocab = engine.model_config.vocab_size
    for r in range(repeats):
        engine.add_request(f"p{length}-{r}", prompt(1000 + r, length, vocab), SamplingParams(max_tokens=1))
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - start)
    return times


def ms(stats: dict[str, float]) -> str:
    return " ".join(f"{k}={1e3 * v:.1f}ms" for k, v in stats.items() if k in ("p50", "p90", "p99"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batches", default="1,16,64", help="decode batch sizes")
    parser.add_argument("--context", type=int, default=512, help="tokens per decoding sequence")
    parser.add_argument("--steps", type=int, default=24, help="decode steps measured per batch size")
    parser.add_argument("--prefill-len", type=int, default=1024)
    parser.add_argument("--backends", default="auto,torch", help="attention backends to compare (auto = compiled CPU kernels)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    bandwidth = measure_read_bandwidth()
    results = {}
    for backend in args.backends.split(","):
        engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, attention_backend=backend,
                                        kv_cache_memory_bytes=4 << 30, max_num_seqs=max(batches),
                                        max_num_batched_tokens=max(2048, args.prefill_len)))
        dtype = next(engine.model.parameters()).dtype
        if backend == args.backends.split(",")[0]:
            peak = matmul_peak(dtype)
            cost = ModelCost.of(engine.model_config, engine.weight_bytes(), torch.finfo(dtype).bits // 8)
            print(f"{args.model} in {dtype}; {torch.get_num_threads()} threads; read bandwidth "
                  f"{bandwidth / 1e9:.1f} GB/s; matmul peak {peak / 1e9:.0f} GFLOP/s; weights {cost.weight_bytes / 1e6:.0f} MB")
        name = engine.model.backend.name
        for b in batches:
            stats = summarize(decode_steps(engine, b, args.context, args.steps))
            memory_s = (cost.weight_bytes + b * args.context * cost.kv_bytes_per_token) / bandwidth
            compute_s = 2 * cost.matmul_params_per_token * b / peak
            floor = max(memory_s, compute_s)
            results[(name, b)] = stats["p50"]
            print(f"[{name}] decode batch {b:3d} @ {args.context}: {ms(stats)} | floor {1e3 * floor:.1f} ms "
                  f"({'memory' if memory_s >= compute_s else 'compute'}) -> p50 {stats['p50'] / floor:.2f}x floor, "
                  f"{b / stats['p50']:.0f} tok/s")
        stats = summarize(prefill_steps(engine, args.prefill_len, 3))
        work = StepWork(num_prefill_tokens=args.prefill_len, num_prefill_seqs=1,
                        num_prefill_attended_tokens=args.prefill_len * (args.prefill_len + 1) // 2)
        mfu = cost.prefill_flops(work) / stats["p50"] / peak
        print(f"[{name}] prefill {args.prefill_len} tokens: {ms(stats)} | {args.prefill_len / stats['p50']:.0f} tok/s, "
              f"MFU {mfu:.0%} of the measured matmul peak")
        results[(name, "prefill")] = stats["p50"]
        engine.close()
    names = sorted({n for n, _ in results})
    if len(names) == 2:
        fast, slow = ("cpu", "torch") if "cpu" in names else names
        print("step-time ratio (torch path / compiled kernels): " + ", ".join(
            f"{k}: {results[(slow, k)] / results[(fast, k)]:.2f}x" for k in [*batches, "prefill"]))


if __name__ == "__main__":
    main()
