"""What a worker's own steps say about its speed: the prefill rate and the decode step time,
as exponentially weighted means, for the router's placement cost model (router/placement/).

A step observer (LLMEngine.add_step_observer) on every prefill and decode worker; the worker's
heartbeat reads the two numbers (proto/worker_messages.py Load). Measured, never configured:
 - prefill tokens/s from steps that computed at least MIN_PREFILL_TOKENS prompt tokens, their
   whole step time counted against the prompt tokens (a mixed step's decode rows are a small
   share of it, and counting them makes the estimate cautious, not optimistic);
 - the decode step time from steps that computed decodes only (the current batch's cost, which
   is what a prompt placed here would delay).
Assigned as whole floats from the step thread and read from the heartbeat thread: each read
sees one value or the other, never a torn one.
"""

from __future__ import annotations

from engine.metrics.step_stats import StepStats

MIN_PREFILL_TOKENS = 32  # smaller prefill steps are dominated by the step's fixed cost
WEIGHT = 0.2  # of each new step in the means (about the last 5-10 steps count)


class StepRates:
    def __init__(self, weight: float = WEIGHT) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.weight = weight
        self.prefill_tokens_per_s = 0.0  # 0: not measured yet
        self.decode_step_s = 0.0  # 0: not measured yet

    def observe(self, stats: StepStats) -> None:
        work, seconds = stats.work, stats.step_time_s
        if seconds <= 0:
            return
        if work.num_prefill_tokens >= MIN_PREFILL_TOKENS:
            self.prefill_tokens_per_s = self._mean(self.prefill_tokens_per_s, work.num_prefill_tokens / seconds)
        elif work.num_prefill_tokens == 0 and work.num_decode_tokens > 0:
            self.decode_step_s = self._mean(self.decode_step_s, seconds)

    def _mean(self, old: float, sample: float) -> float:
        return sample if old == 0 else old + self.weight * (sample - old)
