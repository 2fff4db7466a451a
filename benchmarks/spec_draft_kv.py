"""P/D with a draft model: recompute the draft's prompt KV on the decode worker, or ship it?

    python benchmarks/spec_draft_kv.py --target builtin:code-small --draft builtin:code-draft --threads 1

Today the decode worker recomputes the draft's prompt KV (engine/spec/draft_proposer.py: the
twin's first catch-up is the whole prompt, inside a decode step). Shipping it instead would have
the prefill worker compute it (the same work, moved there) and the KV transport carry it with
the target's pages. For each prompt length this prints, on one torch thread (a worker's core):
the draft's prefill time (what recomputing adds to a decode step), the draft KV's bytes and the
time the ZMQ transport takes to move them into another process's cache
(benchmarks/disagg_transfer.py's link: sender, receiver process, pages of 8 per frame), and the
target's own prefill for scale. Medians over --repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
from disagg_transfer import ZmqLink, prefill_seconds

from configs import EngineConfig
from engine import LLMEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="builtin:code-small")
    parser.add_argument("--draft", default="builtin:code-draft")
    parser.add_argument("--dtype", default="bfloat16", help="the serving dtype (auto picks bf16 with AMX)")
    parser.add_argument("--lengths", default="128,256,512,1000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    common = dict(dtype=args.dtype, kv_cache_memory_bytes=256 << 20, max_num_batched_tokens=2048,
                  enable_prefix_caching=False)
    draft, target = LLMEngine(EngineConfig(model=args.draft, **common)), LLMEngine(EngineConfig(model=args.target, **common))
    page_size = draft.config.page_size
    page_bytes = draft.model_config.kv_bytes_per_token(torch.finfo(draft.kv_cache.k[0].dtype).bits // 8) * page_size
    print(f"draft {args.draft} ({draft.model_config.num_layers} layers), target {args.target} "
          f"({target.model_config.num_layers} layers), {args.dtype}, torch threads {torch.get_num_threads()}, "
          f"draft KV {page_bytes // page_size} bytes per token")
    link = ZmqLink(draft.model_path, args.dtype, 256, page_size)
    salt = 0

    def prefill(engine: LLMEngine, n: int, keep: bool = False) -> tuple[float, list[int]]:
        nonlocal salt
        salt += 1
        seconds, pages = prefill_seconds(engine, n, salt)
        if not keep:
            engine.handoff.release(f"p{salt}")
        return seconds, pages

    prefill(draft, 64), prefill(target, 64)  # warm-up: first-call costs are not what is measured
    _, pages = prefill(draft, 64, keep=True)
    link.transfer_seconds(draft, pages)
    draft.handoff.release(f"p{salt}")
    print(f"{'tokens':>6} {'draft prefill':>14} {'draft KV':>9} {'transfer':>9} {'target prefill':>15}  (ms, p50)")
    for n in (int(x) for x in args.lengths.split(",")):
        draft_s = [prefill(draft, n)[0] for _ in range(args.repeats)]
        target_s = [prefill(target, n)[0] for _ in range(args.repeats)]
        _, pages = prefill(draft, n, keep=True)
        moves = [link.transfer_seconds(draft, pages) for _ in range(args.repeats)]
        draft.handoff.release(f"p{salt}")
        d, t, m = (1000 * statistics.median(x) for x in (draft_s, target_s, moves))
        print(f"{n:6d} {d:14.2f} {len(pages) * page_bytes / 1024:7.0f} KiB {m:9.2f} {t:15.2f}   "
              f"recompute / transfer = {d / m:.2f}")
    link.close()


if __name__ == "__main__":
    main()
