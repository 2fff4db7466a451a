"""Speculative decoding served in 1P1D: concurrency 1 through a cluster started as `pdserve up` does.

    python benchmarks/spec_served.py configs/bench/spec-1p1d-code.yaml --num-prompts 6 --max-tokens 64

Starts the cluster of the YAML (cluster/lifecycle.py's Cluster: the launcher, supervisor and
control socket of `pdserve up`; stopped at the end, nothing left running), then sends each
code-completion prompt (the held-out stdlib files of benchmarks/spec_decode.py, tokenized with
the served model's tokenizer) once per method, one request at a time, the order alternating
from prompt to prompt, over gRPC with the per-request `speculative_method` (loadgen's
RequestOptions: what `pdserve bench --speculative-method` sends), greedy, EOS ignored. Prints per
method the decode tokens/s as the client saw it (first streamed token to last: prefill and the
KV transfer excluded; p50/p90 over prompts and the aggregate), the ratio to `none`, and the
acceptance rate and mean accepted length from the decode worker's Prometheus counters (the
YAML's decode pool must set metrics_base_port), read around each request and summed over the
proposers' labels: the counters are by the method that proposed, so a `prompt_lookup+draft`
request's tokens are counted under `prompt_lookup` and `draft`, and only reading them per
request keeps them apart from those methods' own requests.

    python benchmarks/spec_served.py configs/bench/spec-1p1d-code-tuned.yaml --rates 2,8,24 \
        --num-requests 32 --method prompt_lookup+draft

With --rates: Poisson arrivals up to saturation instead, speculation on (--method, with the
decode pool's adaptive k, thresholds and cost policy) vs off (`none`), through the same cluster.
At each rate both send the same requests at the same seeded arrival times
(loadgen.workloads.arrival_offsets, as benchmarks/spec_poisson.py in-process), one after the
other, the order alternating from rate to rate; per rate the output tokens/s (first arrival to
last token), TPOT p50/p90/p99 and TTFT p50/p99 as the client saw them, the on/off ratios, and
the decode worker's proposed and accepted tokens for the `on` run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from prometheus_client.parser import text_string_to_metric_families
from spec_decode import stdlib_prompts

from configs import load_cluster_config
from loadgen.client import RequestOptions, make_backend
from loadgen.metrics import RequestRecord, Summary, summarize_run
from loadgen.runner import run_load
from loadgen.workloads import BenchRequest, arrival_offsets

COUNTERS = ("pdserve_worker_spec_proposed_tokens", "pdserve_worker_spec_accepted_tokens",
            "pdserve_worker_spec_verify_steps")


def spec_counters(url: str) -> dict[str, float]:
    """counter -> value, summed over the worker's labels (every proposing method's)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        if family.name in COUNTERS:
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[family.name] += sample.value
    return out


async def measure(address: str, prompts: list[list[int]], max_tokens: int, methods: tuple[str, ...],
                  metrics_url: str) -> tuple[dict[str, list[RequestRecord]], dict[str, dict[str, float]]]:
    """Each method's records, and its requests' speculative counters (counter -> total)."""
    records: dict[str, list[RequestRecord]] = {m: [] for m in methods}
    counts = {m: dict.fromkeys(COUNTERS, 0.0) for m in methods}
    async with contextlib.AsyncExitStack() as stack:
        backends = {m: await stack.enter_async_context(make_backend("grpc", address,
                                                                     options=RequestOptions(speculative_method=m)))
                    for m in methods}
        for m in methods:  # warm-up: each method's first-call costs (the draft's too) stay out
            await run_load(backends[m], [BenchRequest(tuple(prompts[0]), 8, "warmup")], [0.0])
        for i, prompt in enumerate(prompts):
            for m in methods if i % 2 == 0 else tuple(reversed(methods)):
                before = spec_counters(metrics_url)  # (outside the timed stream: first token to last)
                [record], _ = await run_load(backends[m], [BenchRequest(tuple(prompt), max_tokens, "code")], [0.0], 1)
                if not record.ok:
                    raise SystemExit(f"request failed ({m}): {record.error}")
                records[m].append(record)
                after = spec_counters(metrics_url)
                for c in COUNTERS:
                    counts[m][c] += after[c] - before[c]
    return records, counts


async def measure_rates(address: str, prompts: list[list[int]], max_tokens: int, method: str, rates: list[float],
                        num_requests: int, seed: int, metrics_url: str) -> None:
    """Prints, per rate, `none` and `method` serving the same seeded Poisson arrivals, and their ratios."""
    requests = [BenchRequest(tuple(prompts[i % len(prompts)]), max_tokens, "code") for i in range(num_requests)]
    async with contextlib.AsyncExitStack() as stack:
        backends = {name: await stack.enter_async_context(make_backend(
                        "grpc", address, options=RequestOptions(speculative_method=m)))
                    for name, m in (("off", "none"), ("on", method))}
        for backend in backends.values():  # warm-up
            await run_load(backend, requests[:2], [0.0, 0.0])
        print(f"{'rate':>6} {'run':>4} {'tok/s':>8} {'TPOT p50':>9} {'p90':>7} {'p99':>7} {'TTFT p50':>9} {'p99':>7}  "
              "(ms)   proposed/accepted")
        for index, rate in enumerate(rates):
            offsets = arrival_offsets(num_requests, rate, seed=seed + index)
            results: dict[str, Summary] = {}
            for name in ("off", "on") if index % 2 == 0 else ("on", "off"):
                before = spec_counters(metrics_url)
                records, duration = await run_load(backends[name], requests, offsets)
                after = spec_counters(metrics_url)
                failed = [r.error for r in records if not r.ok]
                if failed:
                    raise SystemExit(f"{len(failed)} requests failed ({name} at {rate:g} req/s): {failed[0]}")
                s = results[name] = summarize_run(records, duration)
                proposed, accepted = (after[c] - before[c] for c in COUNTERS[:2])
                print(f"{rate:6g} {name:>4} {s.output_token_throughput:8.1f} {s.tpot['p50'] * 1e3:9.2f} "
                      f"{s.tpot['p90'] * 1e3:7.2f} {s.tpot['p99'] * 1e3:7.2f} {s.ttft['p50'] * 1e3:9.1f} "
                      f"{s.ttft['p99'] * 1e3:7.1f}        {proposed:.0f}/{accepted:.0f}")
            on, off = results["on"], results["off"]
            print(f"{rate:6g}  on/off: tok/s {on.output_token_throughput / off.output_token_throughput:.3f}   TPOT "
                  f"p50 {on.tpot['p50'] / off.tpot['p50']:.3f} p90 {on.tpot['p90'] / off.tpot['p90']:.3f} "
                  f"p99 {on.tpot['p99'] / off.tpot['p99']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path)
    parser.add_argument("--methods", default="none,prompt_lookup,draft")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rates", default=None,
                        help="requests/s, comma-separated: a Poisson sweep of --method vs none instead of concurrency 1")
    parser.add_argument("--method", default="prompt_lookup", choices=("prompt_lookup", "draft", "prompt_lookup+draft", "medusa"),
                        help="--rates: the method of the `on` run")
    parser.add_argument("--num-requests", type=int, default=32, help="--rates: requests per rate and run")
    args = parser.parse_args()
    from cluster.lifecycle import Cluster
    from engine.model.loader import load_tokenizer, resolve_model_path

    config = load_cluster_config(args.config)
    if config.decode is None or config.decode.metrics_base_port is None:
        parser.error("the config needs a decode pool with metrics_base_port (the speculative counters)")
    methods = tuple(args.methods.split(","))
    if methods[0] != "none":
        parser.error("--methods must start with none (the baseline)")
    tokenizer = load_tokenizer(resolve_model_path(config.model))
    num_prompts = min(args.num_requests, 12) if args.rates else args.num_prompts  # (--rates: repeats cost the same)
    prompts = stdlib_prompts(lambda text: tokenizer(text)["input_ids"], num_prompts, args.prompt_tokens, args.seed)
    metrics_url = f"http://127.0.0.1:{config.decode.metrics_base_port}/metrics"
    if args.rates:
        rates = [float(r) for r in args.rates.split(",")]
        print(f"on: {args.method}, off: none; {args.num_requests} requests per rate, {args.prompt_tokens}-token "
              f"prompts, {args.max_tokens} tokens each")
        with Cluster(config, args.config) as cluster:
            print(f"cluster up: {args.config} ({config.mode}, model {config.model}), router {cluster.grpc_address}")
            asyncio.run(measure_rates(cluster.grpc_address, prompts, args.max_tokens, args.method, rates,
                                      args.num_requests, args.seed, metrics_url))
        print("cluster stopped")
        return
    with Cluster(config, args.config) as cluster:
        print(f"cluster up: {args.config} ({config.mode}, model {config.model}), router {cluster.grpc_address}")
        records, counts = asyncio.run(measure(cluster.grpc_address, prompts, args.max_tokens, methods, metrics_url))
    print("cluster stopped")
    print(f"concurrency 1: {len(prompts)} prompts x {args.max_tokens} tokens, decode tokens/s as streamed "
          "(first token to last)")
    base = 0.0
    for m in methods:
        decoded = sum(r.num_tokens - 1 for r in records[m])
        seconds = sum(r.token_times[-1] - r.token_times[0] for r in records[m])
        rates = [(r.num_tokens - 1) / (r.token_times[-1] - r.token_times[0]) for r in records[m]]
        agg = decoded / seconds
        base = base or agg
        q = statistics.quantiles(rates, n=10) if len(rates) > 1 else rates * 9
        line = (f"  {m:19s} {agg:8.1f} tok/s  (per prompt p50={statistics.median(rates):.1f} p90={q[8]:.1f})  "
                f"ratio vs none = {agg / base:.2f}")
        proposed, accepted, verified = (counts[m][c] for c in COUNTERS)
        if m != "none":
            line += (f"  server: acceptance rate {accepted / proposed:.2f}  mean accepted length "
                     f"{(accepted + verified) / verified:.2f}  ({proposed:.0f} proposed in {verified:.0f} verifications)"
                     if verified else "  server: nothing proposed")
        print(line)


if __name__ == "__main__":
    main()
