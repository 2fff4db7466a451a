"""What a speculative step costs at concurrency 1: a verification of k proposed tokens against a
plain decode step, and a draft's proposal of k guesses.

    python benchmarks/spec_costs.py --model builtin:code-small --draft builtin:code-draft --threads 1

A method pays when the tokens it adds per step outweigh what its step costs over a plain one
(docs/benchmarks.md, "Speculative decoding"). For one sequence decoding after a --context-token
prompt this prints medians over --repeats of:
  - the target's step with 1 + k rows (k = 0: a plain decode), split as the engine runs it:
    the batch build (engine/model_runner.py), the forward (the fused decode layers on the CPU)
    and the vocabulary projection;
  - the draft's whole greedy proposal of k guesses from a one-token catch-up, the compiled call
    engine/spec/draft_proposer.py makes after each verification (kernels/cpu/greedy_steps.cpp),
    with the draft's weights alone in the caches; then both in turn, as the engine runs them
    (the target's step between two proposals evicts some of the draft's weights, and the other
    way round).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

from configs import EngineConfig
from engine import LLMEngine, SamplingParams
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from engine.spec.draft_decode import decode_inputs
from engine.spec.draft_proposer import DraftModelProposer
from engine.spec.proposer import Proposal


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:code-small")
    parser.add_argument("--draft", default=None, help="a draft checkpoint: also time its proposals")
    parser.add_argument("--draft-vocab-size", type=int, default=None)
    parser.add_argument("--draft-quantization", choices=("none", "int8"), default="none")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--context-tokens", type=int, default=288)
    parser.add_argument("--ks", default="0,1,2,4,6,8")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    speculative: dict = {"method": "none", "cost_policy": False}
    if args.draft:
        speculative |= {"draft_model": args.draft, "draft_vocab_size": args.draft_vocab_size,
                        "draft_quantization": args.draft_quantization}
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, enable_prefix_caching=False,
                                    speculative=speculative))
    print(f"model {args.model}, draft {args.draft}, dtype {next(engine.model.parameters()).dtype}, torch threads "
          f"{torch.get_num_threads()}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"context {args.context_tokens} tokens; medians of {args.repeats} (ms)")
    prompt = [(7 * t) % 4000 + 1 for t in range(args.context_tokens - 1)]
    engine.add_request("x", prompt, SamplingParams(max_tokens=2 * max(ks) + 8, ignore_eos=True))
    engine.step()  # the prefill: the sequence now decodes its first sampled token
    seq = engine.scheduler.running[0]
    assert engine.scheduler.allocate_drafts(seq, max(ks)), "no pages for the proposals"
    runner = engine.runner
    plain = None
    for k in ks:
        scheduled = ScheduledSeq(seq, 1)
        if k:
            scheduled = scheduled.with_draft(Proposal(tuple([5] * k)), "timing")
        batch = runner.build_batch([scheduled])[0]
        hidden = runner.executor.run(batch)
        build = median_ms(lambda s=scheduled: runner.build_batch([s]), args.repeats)  # type: ignore[misc]
        forward = median_ms(lambda b=batch: runner.executor.run(b), args.repeats)  # type: ignore[misc]
        logits = median_ms(lambda h=hidden: runner.logits(h), args.repeats)  # type: ignore[misc]
        total = build + forward + logits
        plain = plain or total
        print(f"target step, {1 + k:2d} rows: build {build:.3f}  forward {forward:.3f}  vocabulary projection "
              f"{logits:.3f}  total {total:.3f} ({total / plain:.2f}x the first line)")
    if args.draft:
        proposer = engine.speculator.proposers["draft"]
        assert isinstance(proposer, DraftModelProposer)
        if proposer.fused_steps is None:
            sys.exit("the draft's steps do not run compiled here (fused layers need AVX512-BF16 and bf16)")
        twin_of = Sequence("d", prompt + [11], SamplingParams(max_tokens=64), 0, 4096)
        proposer.propose([twin_of], [1])  # the twin computes the prompt
        twin = proposer.twins["d"].seq
        twin.num_computed_tokens -= 1  # its last token is the catch-up each timed call feeds
        assert proposer._allocate_through(twin, twin.num_computed_tokens + max(ks) + 1)
        inputs = decode_inputs([twin])
        for k in [k for k in ks if k]:
            steps = torch.tensor([k])
            ms = median_ms(lambda s=steps: proposer.fused_steps(*inputs, s), args.repeats)  # type: ignore[misc]
            print(f"draft proposal of {k} guesses (one compiled call): {ms:.3f}  per guess {ms / k:.3f}  "
                  f"({ms / plain:.2f}x a plain target step)")
        # As the engine runs them: a proposal, then the target's step verifying it, in turn, so
        # each finds in cache what the other left of its weights.
        k = max(ks)
        if k:
            scheduled = ScheduledSeq(seq, 1).with_draft(Proposal(tuple([5] * k)), "timing")
            batch = runner.build_batch([scheduled])[0]
            draft_ms, target_ms = [], []
            guesses = torch.tensor([k])
            for _ in range(args.repeats):
                draft_ms.append(median_ms(lambda: proposer.fused_steps(*inputs, guesses), 1))
                target_ms.append(median_ms(lambda b=batch: runner.logits(runner.executor.run(b)), 1))
            print(f"in turn (draft proposal of {k}, then the target's {1 + k}-row step): draft "
                  f"{statistics.median(draft_ms):.3f}  target {statistics.median(target_ms):.3f}")


if __name__ == "__main__":
    main()
