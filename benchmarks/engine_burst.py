"""The engine alone on vs_vllm.py's burst shapes: what a served run would reach without the router,
the client and the network, and how much a competing process on the same cores costs it.

Sits beside benchmarks/vs_vllm.py (served, against vLLM) and benchmarks/engine_steps.py (single
steps): this runs whole bursts through `LLMEngine.step()` in this process, every request added
at once, and prints requests/s, the prefill phase's time and the decode steps' p50/p90/p99, with
the time inside the attention kernel (`cpu_ops.paged_attention`, timed around each call) split
out. `--load` starts a competitor first: a process that spins for the given milliseconds then
sleeps, again and again (as a router and a client streaming tokens do), so the ratio of the two
runs says how much a served step loses to them.

    python benchmarks/engine_burst.py                              # 32 x 512-token prompts, 128 out
    python benchmarks/engine_burst.py --prefixes 8 --prompt-len 128 --prefix-len 1024   # vs_vllm's prefix workload
    python benchmarks/engine_burst.py --load 0.5,3.5               # and again beside a 12.5%-of-a-core competitor
    python benchmarks/engine_burst.py --python-layers              # decode layers in Python (attention timed)
"""

from __future__ import annotations

import argparse
import random
import re
import subprocess
import sys
import time
from pathlib import Path

from configs import load_cluster_config
from engine import LLM, SamplingParams
from kernels import cpu_ops

CLUSTER_CONFIG = Path(__file__).resolve().parent.parent / "configs/bench/vs-vllm-colocated.yaml"

_SPIN = "import time,sys\nb,i=float(sys.argv[1])/1e3,float(sys.argv[2])/1e3\nwhile True:\n t=time.perf_counter()\n" \
        " while time.perf_counter()-t<b: pass\n time.sleep(i)\n"


class _AttentionTimer:
    """Wraps cpu_ops.paged_attention (before the engine binds it) and adds up its time."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._real = cpu_ops.paged_attention
        cpu_ops.paged_attention = self

    def __call__(self, *args):
        start = time.perf_counter()
        try:
            return self._real(*args)
        finally:
            self.seconds += time.perf_counter() - start


def _pct(values: list[float]) -> str:
    s = sorted(values)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return f"p50 {pick(0.5):.1f} p90 {pick(0.9):.1f} p99 {pick(0.99):.1f}"


def burst(llm: LLM, timer: _AttentionTimer, prompts: list[list[int]], out_len: int, tag: str) -> float:
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", p, SamplingParams(max_tokens=out_len, ignore_eos=True))
    done, steps = 0, []  # (seconds, attention seconds) per step
    started: set[str] = set()  # requests with a first token
    prefill_steps = 0  # steps until the last request's first token: every one carried prompt chunks
    start = time.perf_counter()
    while done < len(prompts):
        timer.seconds = 0.0
        t = time.perf_counter()
        outs = eng.step()
        steps.append((time.perf_counter() - t, timer.seconds))
        done += sum(1 for o in outs if o.finished)
        started.update(o.request_id for o in outs)
        if not prefill_steps and len(started) == len(prompts):
            prefill_steps = len(steps)
    total = time.perf_counter() - start
    decode = steps[prefill_steps:]
    # decode steps run their layers in one compiled call (engine/model/fused_decode.py), which
    # calls the attention kernel from C++, past the timer
    decode_attention = (_pct([s[1] * 1e3 for s in decode]) if llm.engine.model.fused_decode is None
                        else "inside the layers' one compiled call (--python-layers times it)")
    print(f"{tag}: {len(prompts) / total:.2f} req/s ({total:.2f} s, {len(steps)} steps); prefill phase "
          f"{sum(s[0] for s in steps[:prefill_steps]) * 1e3:.0f} ms in {prefill_steps} steps (attention "
          f"{sum(s[1] for s in steps[:prefill_steps]) * 1e3:.0f} ms); decode steps (ms) "
          f"{_pct([s[0] * 1e3 for s in decode])}, attention in them {decode_attention}",
          flush=True)
    return len(prompts) / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=32, help="requests per burst, all added at once")
    parser.add_argument("--prompt-len", type=int, default=512, help="unique prompt tokens per request")
    parser.add_argument("--prefixes", type=int, default=0, help="shared prefixes (0: none), request i uses i %% N")
    parser.add_argument("--prefix-len", type=int, default=1024, help="tokens per shared prefix")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="bursts per setting (fresh prompts each)")
    parser.add_argument("--load", default="", help="BUSY_MS,IDLE_MS: also run beside a competitor that spins/sleeps so")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--python-layers", action="store_true",
                        help="decode steps run their layers in Python, as before the one-call layers")
    args = parser.parse_args()
    if args.load and not re.fullmatch(r"\d+(\.\d+)?,\d+(\.\d+)?", args.load):
        parser.error(f"--load takes BUSY_MS,IDLE_MS (for example 0.5,3.5), not {args.load!r}")

    timer = _AttentionTimer()
    # The engine pdserve's side of vs_vllm.py serves with (page size, KV budget, step budget).
    pool = load_cluster_config(CLUSTER_CONFIG).colocated
    assert pool is not None, f"{CLUSTER_CONFIG} has no colocated pool"
    engine = pool.engine.model_dump() | {"dtype": args.dtype}
    llm = LLM(args.model, **engine)
    if args.python_layers:
        llm.engine.model.fused_decode = None
    rng = random.Random(args.seed)
    vocab = llm.engine.model_config.vocab_size

    def prompts() -> list[list[int]]:
        heads = [[rng.randrange(100, vocab) for _ in range(args.prefix_len)] for _ in range(args.prefixes)]
        return [(heads[i % args.prefixes] if heads else []) + [rng.randrange(100, vocab) for _ in range(args.prompt_len)]
                for i in range(args.requests)]

    burst(llm, timer, prompts()[:4], 8, "warm-up")
    alone = [burst(llm, timer, prompts(), args.output_len, f"alone {r + 1}") for r in range(args.repeats)]
    if args.load:
        busy, idle = args.load.split(",")
        competitor = subprocess.Popen([sys.executable, "-c", _SPIN, busy, idle])
        try:
            loaded = [burst(llm, timer, prompts(), args.output_len, f"loaded {r + 1}") for r in range(args.repeats)]
        finally:
            competitor.kill()
            competitor.wait()
        share = float(busy) / (float(busy) + float(idle))
        print(f"beside a competitor taking {share:.1%} of one core: {sum(loaded) / len(loaded):.2f} against "
              f"{sum(alone) / len(alone):.2f} req/s alone ({sum(loaded) / sum(alone):.2f}x)")
    llm.close()


if __name__ == "__main__":
    main()
