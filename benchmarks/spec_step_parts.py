"""Where a decode step's time goes at concurrency 1, by speculative method, in the engine as it
runs: the step, the proposals (prompt lookup's, the draft's), the batch build and forward, the
vocabulary projection and the verification, per decode step and per emitted token.

Sits beside benchmarks/spec_decode.py (the ratios) and benchmarks/spec_costs.py (each part on its
own, weights hot in cache): this times the same parts inside whole requests, where a draft's
proposal and the target's step evict each other's weights. Same workload as spec_decode.py's
concurrency-1 phase (held-out stdlib prompts, greedy, EOS ignored, the methods alternating from
prompt to prompt on one engine, cost policy off); each request's first step (its prefill, and a
draft's prompt KV beside it) is left out. The timers (benchmarks/step_breakdown.py's) add a few
microseconds a call, a handful of calls a step.

    python benchmarks/spec_step_parts.py --draft-model builtin:code-draft --draft-vocab-size 2048 --draft-quantization int8

A method's ratio to `none` is none's ms a token over its own; the lines say which parts make the
difference (docs/benchmarks.md, "What bounds the ratio on this CPU").
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spec_decode import stdlib_prompts
from step_breakdown import PartTimers

from configs import EngineConfig
from engine import LLMEngine, SamplingParams

# Timed parts, in the order printed: (timer name, what it holds).
PARTS = (
    ("proposals", "speculator.plan: the proposers' calls"),
    ("draft proposals", "of which the draft model's (its catch-up and guesses)"),
    ("build + forward", "runner.execute_hidden: the batch build and the model's forward"),
    ("forward", "of which the forward (on the CPU, the fused decode layers)"),
    ("vocabulary projection", "runner.logits"),
    ("verification", "speculator.sample: acceptance, rejection, the target's tokens"),
)


def instrument(engine: LLMEngine, timers: PartTimers) -> None:
    """Wraps the engine's step and its parts named in PARTS with `timers`."""
    spec, runner = engine.speculator, engine.runner
    engine.step = timers.wrap("step", engine.step)  # type: ignore[method-assign]
    spec.plan = timers.wrap("proposals", spec.plan)  # type: ignore[method-assign]
    spec.sample = timers.wrap("verification", spec.sample)  # type: ignore[method-assign]
    runner.execute_hidden = timers.wrap("build + forward", runner.execute_hidden)  # type: ignore[method-assign]
    runner.logits = timers.wrap("vocabulary projection", runner.logits)  # type: ignore[method-assign]
    engine.model.forward = timers.wrap("forward", engine.model.forward)  # type: ignore[method-assign]
    if (draft := spec.proposers.get("draft")) is not None:  # one instance serves `draft` and the fallback
        draft.propose = timers.wrap("draft proposals", draft.propose)  # type: ignore[method-assign]


def decode_request(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams,
                   timers: PartTimers) -> tuple[int, int]:
    """Runs one request alone; its first step's time is taken back out of `timers`. Returns its
    decode steps and the tokens they emitted."""
    engine.add_request(request_id, prompt, params)
    before = dict(timers.seconds)
    outs = engine.step()  # the prefill (and the first token)
    timers.seconds = defaultdict(float, before)
    steps, tokens = 0, sum(len(o.new_token_ids) for o in outs)
    first = tokens
    while engine.has_unfinished_requests():
        steps += 1
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return steps, tokens - first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:code-small")
    parser.add_argument("--draft-model", default="builtin:code-draft",
                        help="the draft of the draft and prompt_lookup+draft methods (the target's tokenizer)")
    parser.add_argument("--draft-vocab-size", type=int, default=None)
    parser.add_argument("--draft-quantization", choices=("none", "int8"), default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--methods", default="none,prompt_lookup,draft,prompt_lookup+draft",
                        help="comma-separated, none included (the ratios are to it)")
    parser.add_argument("--num-speculative-tokens", type=int, default=5, help="k, fixed (speculative.adaptive off)")
    parser.add_argument("--fallback-ngram-min", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    methods = tuple(args.methods.split(","))
    if "none" not in methods:
        parser.error("--methods must include none (the other methods are compared with it)")
    if args.num_prompts < 1 or args.max_tokens < 2:
        parser.error("--num-prompts must be positive and --max-tokens at least 2 (one decode step)")
    speculative: dict = {"method": "prompt_lookup", "num_tokens": args.num_speculative_tokens, "adaptive": False,
                         "cost_policy": False, "draft_model": args.draft_model,
                         "fallback_ngram_min": args.fallback_ngram_min}
    for key, value in (("draft_vocab_size", args.draft_vocab_size), ("draft_quantization", args.draft_quantization)):
        if value is not None:
            speculative[key] = value
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, speculative=speculative,
                                    enable_prefix_caching=False))
    unknown = [m for m in methods if m != "none" and m not in engine.speculator.proposers]
    if unknown:
        parser.error(f"unknown methods {unknown}; this engine has {sorted(engine.speculator.proposers)}")
    prompts = stdlib_prompts(engine.encode, args.num_prompts, args.prompt_tokens, args.seed)
    timers = PartTimers()
    instrument(engine, timers)
    seconds: dict[str, dict[str, float]] = {m: defaultdict(float) for m in methods}
    steps: dict[str, int] = dict.fromkeys(methods, 0)
    tokens: dict[str, int] = dict.fromkeys(methods, 0)
    decode_request(engine, "warm-up", prompts[0], SamplingParams(max_tokens=4), timers)
    for i, prompt in enumerate(prompts):
        for method in methods if i % 2 == 0 else reversed(methods):
            timers.reset()
            params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, speculative_method=method)
            n_steps, n_tokens = decode_request(engine, f"{method}-{i}", prompt, params, timers)
            steps[method] += n_steps
            tokens[method] += n_tokens
            for name, s in timers.seconds.items():
                seconds[method][name] += s
    print(f"{args.num_prompts} prompts x {args.max_tokens} tokens, k {args.num_speculative_tokens} fixed; "
          f"ms per decode step (prefill steps left out)")
    per_token_none = seconds["none"]["step"] / tokens["none"]
    for method in methods:
        ms = {name: s / steps[method] * 1e3 for name, s in seconds[method].items()}
        per_token = seconds[method]["step"] / tokens[method]
        print(f"{method:20s} {tokens[method] / steps[method]:.2f} tokens a step, step {ms['step']:.3f} ms, "
              f"{per_token * 1e3:.3f} ms a token, ratio to none {per_token_none / per_token:.2f}")
        rest = ms["step"] - ms.get("proposals", 0) - ms.get("build + forward", 0) - ms.get("vocabulary projection", 0) \
            - ms.get("verification", 0)
        for name, what in PARTS:
            if name in ms:
                print(f"    {name:22s} {ms[name]:7.3f}  {what}")
        print(f"    {'the rest':22s} {rest:7.3f}  scheduling, outputs, the step's own bookkeeping")


if __name__ == "__main__":
    main()
