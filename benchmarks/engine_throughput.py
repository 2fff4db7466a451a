"""Engine benchmark: offline throughput vs Hugging Face generate(), and batch-1 decode vs the
memory-bandwidth floor, measured side by side in one run on the same model and prompts.

    python benchmarks/engine_throughput.py                     # builtin:small, float32
    python benchmarks/engine_throughput.py --num-prompts 8 --model builtin:tiny   # quick look

Workload: prompts of uniform random length in [32, 1024] tokens, each with its own output
length in [16, 256] (EOS ignored so lengths are exact), seeded. The engine takes all requests
at once (continuous batching, chunked prefill); Hugging Face takes them in static batches of
`--hf-batch-size` in arrival order, left-padded, each batch running to its longest output
(only the requested tokens count as useful output, as in any static-batching deployment).

Batch-1 decode: one 128-token prompt, 128 greedy tokens; the per-token step time is compared
with weight bytes / read bandwidth, where the bandwidth is the best of several full reads of a
buffer as large as the weights (measured in this run, same threads).
Prints p50/p90/p99 per-token latencies and the ratios.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

from configs import EngineConfig
from engine import LLMEngine, SamplingParams
from engine.metrics.peak import measure_read_bandwidth
from engine.model.loader import DTYPES
from loadgen.metrics import summarize


def fmt_ms(stats: dict[str, float]) -> str:
    return " ".join(f"{k}={1000 * v:.2f}ms" for k, v in stats.items())


def make_workload(vocab: int, n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([0] + [rng.randrange(3, vocab) for _ in range(rng.randint(32, 1024) - 1)], rng.randint(16, 256))
            for _ in range(n)]


def run_engine(engine: LLMEngine, workload) -> tuple[float, list[float], list[list[int]]]:
    """All requests at once; returns wall time, inter-token latencies, outputs."""
    for i, (prompt, out_len) in enumerate(workload):
        engine.add_request(f"b{i}", prompt, SamplingParams(max_tokens=out_len, ignore_eos=True))
    last_token_at: dict[str, float] = {}
    itl: list[float] = []
    outputs: dict[str, list[int]] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            if out.request_id in last_token_at:
                itl.append(now - last_token_at[out.request_id])
            last_token_at[out.request_id] = now
            if out.finished:
                outputs[out.request_id] = out.token_ids
    wall = time.perf_counter() - start
    return wall, itl, [outputs[f"b{i}"] for i in range(len(workload))]


def run_hf(model, workload, batch_size: int, pad_id: int) -> tuple[float, list[list[int]]]:
    outputs = []
    start = time.perf_counter()
    for b in range(0, len(workload), batch_size):
        batch = workload[b : b + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(batch):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.no_grad():
            seqs = model.generate(ids, attention_mask=mask, max_new_tokens=max(n for _, n in batch),
                                  do_sample=False, eos_token_id=None, pad_token_id=pad_id)
        outputs += [seqs[row, width : width + n].tolist() for row, (_, n) in enumerate(batch)]
    return time.perf_counter() - start, outputs


def batch1_decode(engine: LLMEngine, vocab: int, num_tokens: int = 128) -> list[float]:
    rng = random.Random(1)
    engine.add_request("solo", [0] + [rng.randrange(3, vocab) for _ in range(127)],
                       SamplingParams(max_tokens=num_tokens, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return times[1:]  # the first step is the prefill


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true", help="only the engine and the bandwidth floor")
    args = parser.parse_args()

    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory_bytes=3 << 30,
                                    max_num_seqs=64, max_num_batched_tokens=2048))
    vocab = engine.model_config.vocab_size
    weight_bytes = engine.weight_bytes()
    print(f"model {args.model} ({weight_bytes / 1e6:.0f} MB of {args.dtype} weights), "
          f"torch threads {torch.get_num_threads()}, pages {engine.page_manager.num_pages}")

    # 1. Batch-1 decode against the bandwidth floor (bandwidth measured right before).
    bandwidth = measure_read_bandwidth(weight_bytes, repeats=7)
    floor = weight_bytes / bandwidth
    decode = batch1_decode(engine, vocab)
    d = summarize(decode)
    print(f"\n[batch-1 decode] read bandwidth {bandwidth / 1e9:.1f} GB/s -> floor {1000 * floor:.2f} ms/token")
    print(f"  per-token {fmt_ms(d)}")
    print(f"  ratio p50 / floor = {d['p50'] / floor:.2f}x   (target <= 1.5x)")

    # 2. Offline throughput: engine vs HF static batches, same prompts.
    workload = make_workload(vocab, args.num_prompts, args.seed)
    useful = sum(n for _, n in workload)
    prompt_tokens = sum(len(p) for p, _ in workload)
    print(f"\n[throughput] {len(workload)} prompts, {prompt_tokens} prompt tokens, {useful} output tokens")
    wall, itl, ours = run_engine(engine, workload)
    print(f"  pdserve engine: {wall:.1f} s, {useful / wall:.1f} output tok/s, "
          f"{(useful + prompt_tokens) / wall:.1f} total tok/s, {engine.num_steps} steps")
    print(f"  inter-token latency {fmt_ms(summarize(itl))}")
    if args.skip_hf:
        return 0
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(engine.model_path), dtype=DTYPES[args.dtype]).eval()
    hf_wall, theirs = run_hf(hf, workload, args.hf_batch_size, pad_id=2)
    print(f"  HF generate (static batches of {args.hf_batch_size}): {hf_wall:.1f} s, "
          f"{useful / hf_wall:.1f} output tok/s")
    same = sum(a == b for a, b in zip(ours, theirs))
    print(f"  greedy outputs identical to HF: {same}/{len(workload)}")
    print(f"  throughput ratio pdserve / HF = {hf_wall / wall:.2f}x   (target >= 3x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
