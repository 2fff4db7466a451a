"""Where one engine step's time goes, part by part: the linear layers by kind, attention, the
norms and fused element-wise kernels, the vocabulary projection, and what is left for Python
(scheduling, batch building, sampling).

Sits beside benchmarks/engine_burst.py (whole bursts) and benchmarks/engine_steps.py (step time
against its roofline): this wraps each part of the model that one step calls with a timer
(every part runs synchronously on the CPU, so wall time is its cost) and reports, per step, the
mean milliseconds of each, for two shapes of vs_vllm.py's burst (the layers run in Python so
that their parts can be timed; the decode steps are timed again as the engine runs them, its
layers in one compiled call, engine/model/fused_decode.py):
  prefill  one --prompt-len prompt at a time, alone in its step (a lone request's TTFT);
  decode   --batch sequences decoding together, each past a --prompt-len prompt.
The engine settings are vs_vllm.py's (configs/bench/vs-vllm-colocated.yaml), as engine_burst.py's.
The timers add a few microseconds per call (~100 calls a step); compare parts, not totals, with
other benchmarks.

    python benchmarks/step_breakdown.py
    python benchmarks/step_breakdown.py --batch 16 --prompt-len 1024
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs import load_cluster_config
from engine import LLM, SamplingParams
from engine.model import llama

CLUSTER_CONFIG = Path(__file__).resolve().parent.parent / "configs/bench/vs-vllm-colocated.yaml"


class PartTimers:
    """Seconds per named part, added up across calls until `reset`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
        return timed

    def reset(self) -> None:
        self.seconds.clear()


class _FusedOps:
    """The backend's fused-kernel module with each kernel timed under its own name, but the
    norms' (inside the norms' own timers already)."""

    def __init__(self, fused, timers: PartTimers) -> None:
        self._fused, self._timers = fused, timers

    def __getattr__(self, name: str):
        kernel = getattr(self._fused, name)
        return kernel if "norm" in name else self._timers.wrap(name, kernel)


def instrument(llm: LLM, timers: PartTimers) -> None:
    """Wraps the step, the model's forward and logits, each layer's linears and norms, attention
    and the fused kernels of `llm`'s engine. The layers run in Python, where the parts can be
    timed, not in one compiled call (engine/model/fused_decode.py; main() times that after)."""
    eng = llm.engine
    model = eng.model
    model.fused_decode = None
    llama.paged_attention = timers.wrap("attention", llama.paged_attention)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj.forward = timers.wrap("linear qkv", attn.qkv_proj.forward)
        attn.o_proj.forward = timers.wrap("linear o", attn.o_proj.forward)
        mlp.gate_up_proj.forward = timers.wrap("linear gate_up", mlp.gate_up_proj.forward)
        mlp.down_proj.forward = timers.wrap("linear down", mlp.down_proj.forward)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.add_norm = timers.wrap("norms (with residual adds)", norm.add_norm)
    if model.backend.fused_ops is not None:
        model.backend.fused_ops = _FusedOps(model.backend.fused_ops, timers)
    model.forward = timers.wrap("model forward", model.forward)
    model.compute_logits = timers.wrap("vocabulary projection", model.compute_logits)
    eng.step = timers.wrap("step", eng.step)


def report(title: str, timers: PartTimers, steps: int) -> None:
    ms = {name: s / steps * 1e3 for name, s in timers.seconds.items()}
    step, forward = ms.pop("step"), ms.pop("model forward")
    print(f"{title}: step {step:.2f} ms (model forward {forward:.2f}; outside it {step - forward:.2f})")
    for name, value in sorted(ms.items(), key=lambda kv: -kv[1]):
        print(f"  {name:28s} {value:7.2f} ms  {value / step:6.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32, help="sequences decoding together")
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed (prefill: prompts timed)")
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    if args.prompt_len < 1 or args.batch < 1 or args.steps < 1:
        parser.error("--prompt-len, --batch and --steps must be positive")

    pool = load_cluster_config(CLUSTER_CONFIG).colocated
    assert pool is not None, f"{CLUSTER_CONFIG} has no colocated pool"
    llm = LLM(args.model, **(pool.engine.model_dump() | {"dtype": args.dtype}))
    eng = llm.engine
    rng = random.Random(args.seed)
    vocab = eng.model_config.vocab_size

    def prompt() -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(args.prompt_len)]

    timers = PartTimers()
    fused = eng.model.fused_decode
    instrument(llm, timers)
    # Prefill: each prompt alone, to its first token; the first two warm the kernels up.
    for i in range(args.steps // 4 + 2):
        if i == 2:
            timers.reset()
        eng.add_request(f"p{i}", prompt(), SamplingParams(max_tokens=1, ignore_eos=True))
        while not any(o.finished for o in eng.step()):
            pass
    report(f"prefill, one {args.prompt_len}-token prompt a step", timers, args.steps // 4)
    # Decode: the batch prefilled first (untimed), then steps with every sequence decoding.
    for i in range(args.batch):
        eng.add_request(f"d{i}", prompt(), SamplingParams(max_tokens=2 * args.steps + 16, ignore_eos=True))
    while len(eng.scheduler.running) < args.batch or any(
            s.num_computed_tokens < args.prompt_len for s in eng.scheduler.running):
        eng.step()
    for _ in range(4):
        eng.step()
    timers.reset()
    for _ in range(args.steps):
        eng.step()
    report(f"decode, {args.batch} sequences past {args.prompt_len}-token prompts", timers, args.steps)
    # The same steps with the layers in one compiled call, where the engine does that: only the
    # forward and what lies outside it can be timed then.
    eng.model.fused_decode = fused
    if fused is not None:
        for _ in range(2):
            eng.step()
        timers.reset()
        for _ in range(args.steps):
            eng.step()
        report("the same decode steps with the layers in one compiled call (the engine's default)", timers,
               args.steps)
    llm.close()


if __name__ == "__main__":
    main()
