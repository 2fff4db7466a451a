"""The cost model's inputs for one request, read from what the router knows now: the workers'
heartbeats (rates, links, health: router/worker_pool.py), its own counts of prompt tokens sent
and not yet prefilled (the prefill gate for prefill workers, `local_queue` for prompts placed on
decode workers), and the KV block index (which worker holds how much of the prompt).

Priors: a worker that has not measured a rate yet (a decode worker that never prefilled, a new
worker) is given its pool's mean measured rate, else the other pool's (the same model and
engine computes the prompt either way), so the first local placement can be considered at all;
with nothing measured anywhere, rates are 0 and decide.py falls back to the queues alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from router.placement.cost_model import DecodeSide, LinkCost, PrefillSide
from router.placement.decide import RemoteOption
from router.policy import WorkerLoad
from router.token_counts import TokenCounts


def local_queue() -> TokenCounts:
    """Prompt tokens the router placed on each decode worker whose first token has not come
    back yet: that worker's own prefill queue, as fresh as the router's last dispatch."""
    return TokenCounts("local queue")


def _mean_rate(loads: Sequence[WorkerLoad]) -> float:
    rates = [w.prefill_tokens_per_s for w in loads if w.prefill_tokens_per_s > 0]
    return sum(rates) / len(rates) if rates else 0.0


def prior_rates(prefills: Sequence[WorkerLoad], decodes: Sequence[WorkerLoad]) -> tuple[float, float]:
    """(prefill pool prior, decode pool prior): each pool's mean measured prefill rate, else the other's."""
    p, d = _mean_rate(prefills), _mean_rate(decodes)
    return p or d, d or p


def prefill_sides(loads: Sequence[WorkerLoad], queued: Callable[[str], int], cached: Callable[[str], int],
                  prior: float) -> list[PrefillSide]:
    return [PrefillSide(w.worker_id, w.prefill_tokens_per_s or prior, queued(w.worker_id), cached(w.worker_id))
            for w in loads if w.healthy]


def decode_sides(loads: Sequence[WorkerLoad], queued: Callable[[str], int], cached: Callable[[str], int],
                 prior: float) -> list[DecodeSide]:
    return [DecodeSide(w.worker_id, w.prefill_tokens_per_s or prior, w.decode_step_s,
                       max(queued(w.worker_id), w.queued_tokens), w.running, cached(w.worker_id))
            for w in loads if w.healthy]


def remote_options(prefills: Sequence[PrefillSide], decodes: Sequence[DecodeSide],
                   link: Callable[[str, str], LinkCost | None]) -> list[RemoteOption]:
    """Each prefill worker with a KV route to some healthy decode worker, with its cheapest link
    (`link(prefill, decode)`: None where no route exists)."""
    options = []
    for p in prefills:
        links = [c for d in decodes if (c := link(p.worker_id, d.worker_id)) is not None]
        if links:
            options.append(RemoteOption(p, min(links, key=lambda c: (c.latency_s, -c.bytes_per_s))))
    return options
