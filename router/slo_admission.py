"""SLO-aware admission (`router.slo_admission_factor`): a request whose predicted TTFT is past
`factor` x `router.slo_ttft_ms` is refused at once (RESOURCE_EXHAUSTED, HTTP 429, with a
Retry-After), never admitted to wait for a first token that would miss the target anyway and
hold its place in the queue while it does. Off by default.

Where it sits: the router's front door (router/server.py), after the request is validated and
before it is admitted; nothing has been sent to a worker, so a refusal frees nothing.

The prediction uses only what is measured (the workers' prefill rates from their real steps,
sent in heartbeats: engine/metrics/rates.py) and the router's own, fresh counts of prompt tokens
not yet computed:
  disaggregated  the placement the request would get now (router/placement/placer.py): its
                 predicted TTFT behind the prompts queued on that worker and in the prefill gate.
  colocated      (unprefilled tokens of admitted requests + this prompt) / the sum of the
                 healthy workers' measured prefill rates.
No measured rate yet (a cluster that has served nothing): no prediction, the request is admitted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc

from router.journey_state import RouterError


@dataclass(frozen=True)
class SloAdmission:
    ttft_target_s: float
    factor: float  # refuse past factor x the target

    @property
    def bound_s(self) -> float:
        return self.factor * self.ttft_target_s

    def check(self, predicted_ttft_s: float | None) -> None:
        """Raises RESOURCE_EXHAUSTED (with a retry hint) when the prediction is past the bound."""
        if predicted_ttft_s is None or predicted_ttft_s <= self.bound_s:
            return
        # Retry once the queue ahead has drained to within the bound, at least a second away.
        retry_after_s = max(1, math.ceil(predicted_ttft_s - self.bound_s))
        raise SloRefused(f"predicted time to first token {predicted_ttft_s:.2f} s is past "
                         f"{self.factor:g} x the {1000 * self.ttft_target_s:g} ms TTFT target "
                         f"(router.slo_admission_factor); retry in {retry_after_s} s", retry_after_s)


class SloRefused(RouterError):
    """A request refused because it would miss the TTFT target; `retry_after_s`: the hint the
    gRPC trailer `retry-after` and the HTTP `Retry-After` header carry."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        self.retry_after_s = retry_after_s


def colocated_ttft_s(unprefilled_tokens: int, prompt_tokens: int, rates: list[float]) -> float | None:
    """Predicted TTFT on a colocated pool whose healthy workers prefill at `rates` tokens/s
    (0: not measured yet), behind `unprefilled_tokens` admitted and not yet computed."""
    measured = [r for r in rates if r > 0]
    if not measured:
        return None
    return (unprefilled_tokens + prompt_tokens) / sum(measured)
