"""Multi-turn sessions on 1P2D: cache-aware decode routing against cache-blind, side by side.

Each of --sessions sessions runs --turns turns one after the other: turn 1 is a session prompt
(--system-tokens of its own, random, seeded) plus --user-tokens; turn k+1 is turn k's prompt, its
--output-tokens of greedy reply and another --user-tokens, as a chat client resends the history.
The sessions run concurrently, each turn sent when the previous one ended (plus --think-s), against
two builtin:small 1P2D clusters on the same cores, one after the other (cluster/lifecycle.py, as
`pdserve up` runs them):

  aware  the defaults: router.policy prefix_affinity and router.placement.cache_aware (placement
         weighs each worker's cached prefix from its KV block events, router/placement/)
  blind  router.policy least_loaded and router.placement.cache_aware false: the same cluster,
         routing without looking at any cache

Prints per routing, for turns >= 2: TTFT p50/p90/p99, the placements, and the prefix hit rate
against the ideal (the whole previous turn, prompt and reply, in full pages): overall (the
`Usage.cached_prompt_tokens` of wherever the prompt was computed) and decode-side (only prompts
computed on a decode worker, placements local and suffix); then aware/blind ratios. Writes the
per-turn records as JSON under --out.

    python benchmarks/multiturn_prefix.py                  # 8 sessions x 4 turns, ~6 minutes
    python benchmarks/multiturn_prefix.py --sessions 4 --turns 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PAGE = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_config(blind: bool) -> dict:
    """1P2D builtin:small on the machine's cores, 2/3 of a CPU each (as configs/bench/disagg-1p2d-small.yaml)."""
    engine = {"page_size": PAGE, "dtype": "float32"}
    pool = {"num_cpus_per_worker": 0.66}
    router = {"host": "127.0.0.1", "grpc_port": free_port(), "worker_event_port": free_port(),
              "control_port": free_port(), "max_queued_requests": 512, "disaggregation": "adaptive"}
    if blind:
        router.update(policy="least_loaded", placement={"cache_aware": False})
    return {"model": "builtin:small", "mode": "disaggregated", "router": router,
            "prefill": {**pool, "num_workers": 1, "base_port": free_port(),
                        "engine": {**engine, "max_num_batched_tokens": 4096}},
            "decode": {**pool, "num_workers": 2, "base_port": free_port(), "kv_base_port": free_port(),
                       "engine": {**engine, "max_num_seqs": 64, "max_num_batched_tokens": 512}},
            "kv_transfer": {"transport": "zmq", "timeout_s": 30}}


def run_sessions(address: str, args: argparse.Namespace, vocab: int, seed: int = 1000,
                 turns: int | None = None) -> list[dict]:
    """Every session's turns (`turns`, default --turns) against the router at `address`, the
    sessions' tokens drawn from `seed`; one record per turn."""
    import grpc

    from proto import pdserve_pb2 as pb
    from proto import pdserve_pb2_grpc

    records: list[dict] = []
    lock = threading.Lock()

    def session(index: int) -> None:
        rng = random.Random(seed + index)
        words = lambda n: [rng.randrange(5, vocab) for _ in range(n)]  # noqa: E731 - seeded token ids
        history = [0] + words(args.system_tokens)
        with grpc.insecure_channel(address) as channel:
            stub = pdserve_pb2_grpc.GenerationStub(channel)
            previous = 0
            for turn in range(1, (turns or args.turns) + 1):
                prompt = history + words(args.user_tokens)
                request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
                    max_tokens=args.output_tokens, ignore_eos=True))
                start = time.monotonic()
                ttft, tokens, usage = None, [], None
                for response in stub.Generate(request, timeout=300):
                    if response.token_ids and ttft is None:
                        ttft = time.monotonic() - start
                    tokens += list(response.token_ids)
                    if response.HasField("usage"):
                        usage = response.usage
                assert usage is not None and ttft is not None, f"session {index} turn {turn}: no reply"
                with lock:
                    records.append({"session": index, "turn": turn, "prompt_tokens": len(prompt), "ttft_s": ttft,
                                    "cached_tokens": usage.cached_prompt_tokens, "placement": usage.placement,
                                    "ideal_cached_tokens": previous // PAGE * PAGE})
                history = prompt + tokens
                previous = len(history)
                time.sleep(args.think_s)

    threads = [threading.Thread(target=session, args=(i,)) for i in range(args.sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


def quantiles(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)

    def q(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))]

    return q(0.5), q(0.9), q(0.99)


def summary(records: list[dict]) -> dict:
    later = [r for r in records if r["turn"] >= 2]
    ideal = sum(r["ideal_cached_tokens"] for r in later)
    on_decode = sum(r["cached_tokens"] for r in later if r["placement"] in ("local", "suffix"))
    placements: dict[str, int] = {}
    for r in later:
        placements[r["placement"]] = placements.get(r["placement"], 0) + 1
    return {"ttft_s": quantiles([r["ttft_s"] for r in later]), "turn1_ttft_s": quantiles(
        [r["ttft_s"] for r in records if r["turn"] == 1]), "hit": sum(r["cached_tokens"] for r in later) / ideal,
            "decode_hit": on_decode / ideal, "placements": placements, "turns": len(later)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=8, help="concurrent sessions (default 8)")
    parser.add_argument("--turns", type=int, default=4, help="turns per session (default 4)")
    parser.add_argument("--system-tokens", type=int, default=512, help="each session's own opening (default 512)")
    parser.add_argument("--user-tokens", type=int, default=64, help="new tokens each turn (default 64)")
    parser.add_argument("--output-tokens", type=int, default=32, help="reply tokens each turn (default 32)")
    parser.add_argument("--think-s", type=float, default=0.5, help="pause between a reply and the next turn")
    parser.add_argument("--out", default="bench-multiturn", help="results directory (default bench-multiturn)")
    args = parser.parse_args()
    if min(args.sessions, args.turns, args.system_tokens, args.user_tokens, args.output_tokens) < 1 or args.turns < 2:
        parser.error("sessions, tokens must be >= 1 and turns >= 2 (turns >= 2 are what is measured)")

    from cluster.launcher import RUN_DIR_ENV
    from cluster.lifecycle import Cluster
    from configs import load_cluster_config
    from engine.model.loader import resolve_model_path

    vocab = json.loads((Path(resolve_model_path("builtin:small")) / "config.json").read_text())["vocab_size"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in ("aware", "blind"):
        with tempfile.TemporaryDirectory(prefix=f"pdserve-multiturn-{name}-") as work:
            path = Path(work) / f"{name}.yaml"
            path.write_text(yaml.safe_dump(cluster_config(blind=name == "blind")))
            os.environ[RUN_DIR_ENV] = str(Path(work) / "run")
            cluster = Cluster(load_cluster_config(path), path, say=lambda line, name=name: print(f"  [{name}] {line}"))
            print(f"== {name}: starting 1P2D", flush=True)
            try:
                cluster.start()
                # Warm-up sessions of their own tokens (no prefix shared with the measured ones):
                # the workers' rates get measured, as on a cluster that has served a while.
                run_sessions(cluster.grpc_address, args, vocab, seed=90_000, turns=2)
                records = run_sessions(cluster.grpc_address, args, vocab)
            finally:
                cluster.shutdown()
        (out / f"{name}.json").write_text(json.dumps(records, indent=1))
        results[name] = summary(records)
        s = results[name]
        print(f"== {name}: turns >= 2: TTFT p50/p90/p99 {'/'.join(f'{1000 * v:.0f}' for v in s['ttft_s'])} ms; "
              f"hit rate {s['hit']:.0%} of ideal, decode-side {s['decode_hit']:.0%}; placements {s['placements']}",
              flush=True)
    aware, blind = results["aware"], results["blind"]
    print(f"\n{args.sessions} sessions x {args.turns} turns ({args.system_tokens} + {args.user_tokens}/turn in, "
          f"{args.output_tokens} out), 1P2D builtin:small float32; turns >= 2:")
    print("| routing | TTFT p50 | TTFT p90 | TTFT p99 | prefix hit / ideal | decode-side hit / ideal | placements |")
    print("|---|---|---|---|---|---|---|")
    for name, s in results.items():
        p50, p90, p99 = (f"{1000 * v:.0f} ms" for v in s["ttft_s"])
        print(f"| {name} | {p50} | {p90} | {p99} | {s['hit']:.0%} | {s['decode_hit']:.0%} | "
              f"{', '.join(f'{k} {v}' for k, v in sorted(s['placements'].items()))} |")
    print(f"\nTTFT p50 on turns >= 2, blind / aware: {blind['ttft_s'][0] / aware['ttft_s'][0]:.2f}x "
          f"(p90 {blind['ttft_s'][1] / aware['ttft_s'][1]:.2f}x); turn 1 TTFT p50 aware "
          f"{1000 * aware['turn1_ttft_s'][0]:.0f} ms, blind {1000 * blind['turn1_ttft_s'][0]:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
