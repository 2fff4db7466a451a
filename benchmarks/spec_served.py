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
from loadgen.metrics import RequestRecord
from loadgen.runner import run_load
from loadgen.workloads import BenchRequest

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path)
    parser.add_argument("--methods", default="none,prompt_lookup,draft")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
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
    prompts = stdlib_prompts(lambda text: tokenizer(text)["input_ids"], args.num_prompts, args.prompt_tokens, args.seed)
    metrics_url = f"http://127.0.0.1:{config.decode.metrics_base_port}/metrics"
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
