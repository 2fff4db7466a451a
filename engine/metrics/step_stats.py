"""What one engine step did, as plain numbers: the facts live metrics are computed from.

`LLMEngine.step` builds a `StepWork` from the scheduler's choice (before progress advances),
times the step, and hands a `StepStats` to every step observer it was given
(`LLMEngine.add_step_observer`); engine/metrics/worker_metrics.py is the observer a worker process installs.
Nothing here is global: each engine reports its own steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.scheduler import ScheduledSeq
from engine.spec.speculator import SpecStepStats


@dataclass(frozen=True)
class StepWork:
    """The tokens one step computes, split by phase. A decode computes a sequence's one newest,
    generated token; everything else (prompt chunks, and recomputation after preemption) is
    prefill work."""

    num_prefill_tokens: int = 0
    num_prefill_seqs: int = 0
    # Sum over prefill tokens of the context each attends to (itself and every earlier
    # token): the attention FLOPs of a causal prefill grow with it.
    num_prefill_attended_tokens: int = 0
    num_decode_tokens: int = 0  # one per decoding sequence, 1 + k for one verifying k proposed tokens
    num_decode_context_tokens: int = 0  # KV tokens the decodes read

    @staticmethod
    def of(scheduled: Iterable[ScheduledSeq]) -> StepWork:
        prefill = prefill_seqs = attended = decode = context = 0
        for s in scheduled:
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            if n == 1 and start == seq.num_tokens - 1 and start >= seq.num_prompt_tokens:
                decode += 1
                context += start + 1
            elif s.draft is not None:
                # A decode verifying k proposals: 1 + k decode rows over the same pages, whose KV a
                # step need move from memory once (the roofline's bytes; later rows hit the cache).
                decode += n
                context += start + n
            else:
                prefill += n
                prefill_seqs += 1
                attended += n * start + n * (n + 1) // 2  # sum of (p + 1) for p in [start, start + n)
        return StepWork(prefill, prefill_seqs, attended, decode, context)


@dataclass(frozen=True)
class StepStats:
    work: StepWork
    step_time_s: float  # schedule + model + sample, wall clock
    queue_times_s: tuple[float, ...]  # arrival -> first scheduled, of sequences scheduled for the first time
    num_pages_used: int  # after the step
    num_pages_free: int
    spec: SpecStepStats = field(default_factory=SpecStepStats)  # proposals verified this step, by method
