"""`pdserve bench`: a seeded load generator for a running router (gRPC), with the field's metrics.

Workloads: `fixed` (given input/output lengths), `mixed` (mostly short prompts, some long:
the prefill/decode interference case), `prefix` (N shared prefixes + unique suffixes).
Arrivals are a burst (`--rate inf`) or Poisson at the given rate. Every request uses
ignore_eos so output lengths are exact. Results: a summary on stdout, JSON and CSV files.
(Sweeps, HTTP targets, plots and `bench compare` are still to come.)
"""

from __future__ import annotations

import asyncio
import csv
import json
import math
import random
import time
from dataclasses import asdict
from pathlib import Path

import grpc

from cluster.bench_metrics import SLO, RequestRecord, summarize_run
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc

WORKLOADS = ("fixed", "mixed", "prefix")


def make_requests(workload: str, num: int, input_len: int, output_len: int, vocab: int, seed: int
                  ) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs, reproducible from the seed."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    if workload == "fixed":
        return [([0] + tokens(input_len - 1), output_len) for _ in range(num)]
    if workload == "mixed":  # 90% short chats, 10% long documents
        return [([0] + tokens((input_len * 8 if rng.random() < 0.1 else input_len) - 1), output_len) for _ in range(num)]
    if workload == "prefix":
        prefixes = [[0] + tokens(input_len - 1) for _ in range(4)]
        return [(rng.choice(prefixes) + tokens(16), output_len) for _ in range(num)]
    raise ValueError(f"unknown workload {workload!r}; choose one of {WORKLOADS}")


async def _one(stub, prompt: list[int], output_len: int, arrival: float) -> RequestRecord:
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                             sampling=pb.SamplingParams(max_tokens=output_len, ignore_eos=True))
    times, n = [], 0
    try:
        async for resp in stub.Generate(req, timeout=600):
            if resp.token_ids:
                times.append(time.perf_counter())
                n += len(resp.token_ids)
        return RequestRecord(arrival, tuple(times), n, len(prompt))
    except grpc.aio.AioRpcError as exc:
        return RequestRecord(arrival, tuple(times), n, len(prompt), ok=False, error=exc.code().name)


async def run_load(address: str, requests: list[tuple[list[int], int]], rate: float, seed: int
                   ) -> tuple[list[RequestRecord], float]:
    rng = random.Random(seed + 1)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        start = time.perf_counter()
        tasks = []
        for prompt, output_len in requests:
            tasks.append(asyncio.create_task(_one(stub, prompt, output_len, time.perf_counter())))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        records = await asyncio.gather(*tasks)
        return list(records), time.perf_counter() - start


def write_results(out_dir: Path, name: str, records: list[RequestRecord], summary) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out_dir / f"{name}.json", out_dir / f"{name}.csv"
    json_path.write_text(json.dumps({"summary": asdict(summary), "requests": [
        {"ok": r.ok, "error": r.error, "prompt_tokens": r.prompt_tokens, "output_tokens": r.num_tokens,
         "ttft_s": r.ttft, "tpot_s": r.tpot, "e2e_s": r.e2e} for r in records]}, indent=2))
    with csv_path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["ok", "error", "prompt_tokens", "output_tokens", "ttft_s", "tpot_s", "e2e_s"])
        for r in records:
            w.writerow([r.ok, r.error, r.prompt_tokens, r.num_tokens, r.ttft, r.tpot, r.e2e])
    return json_path, csv_path


def bench(address: str, workload: str, num_prompts: int, input_len: int, output_len: int, rate: float, seed: int,
          vocab: int, out_dir: Path, slo: SLO, say=print):
    requests = make_requests(workload, num_prompts, input_len, output_len, vocab, seed)
    records, duration = asyncio.run(run_load(address, requests, rate, seed))
    summary = summarize_run(records, duration, slo)
    say(f"{workload}: {summary.num_requests} requests ({summary.num_failed} failed) in {duration:.2f} s | "
        f"{summary.request_throughput:.2f} req/s, {summary.output_token_throughput:.1f} output tok/s")
    for name in ("ttft", "tpot", "itl", "e2e"):
        stats = getattr(summary, name)
        say(f"  {name.upper():5s} " + " ".join(f"{k}={1000 * v:.1f}ms" for k, v in stats.items()))
    if not math.isnan(summary.attainment):
        say(f"  goodput {summary.goodput:.2f} req/s, SLO attainment {summary.attainment:.0%}")
    paths = write_results(out_dir, f"bench-{workload}", records, summary)
    say(f"  wrote {paths[0]} and {paths[1]}")
    return summary
