"""Where one request's prompt is computed: on a prefill worker with its KV shipped (remote), on
the decode worker itself (local), or, where that decode worker already holds a prefix of it,
only the uncached suffix there (suffix). A pure function of the candidates' measured costs
(cost_model.py) and `router.disaggregation`:

  always    remote, unless no prefill worker can take the request (the pool is empty or down,
            or no KV link reaches a decode worker): then local, as a fallback.
  never     local, on the decode worker it costs least.
  adaptive  the cheaper of the two. A remote option costs its predicted time until decoding can
            start (TTFT plus the KV's tail over the link); a local one its predicted TTFT plus
            `stall_weight` x its stall x the requests running there, the delay it puts on others.
            Local must beat remote by `margin` (a share of remote's cost): disaggregation keeps
            decode steps free of prefill, which a tie should not give away. A decode worker whose
            decode steps are already past `max_local_step_share` of the TPOT target takes no
            local prompt. Before any prefill rate is measured, remote.

Each choice names its reason (`pdserve_placement_decisions_total{placement,reason}`, the
request's "placed" log line).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.placement.cost_model import (
    DecodeSide,
    LinkCost,
    PrefillSide,
    local_stall_s,
    local_ttft_s,
    remote_ttft_s,
    transfer_s,
)

MODES = ("always", "adaptive", "never")
REMOTE, LOCAL, SUFFIX = "remote", "local", "suffix"


@dataclass(frozen=True)
class PlacementSettings:
    mode: str = "adaptive"
    stall_weight: float = 0.5  # what a second of stall on each running request counts against TTFT
    margin: float = 0.2  # local wins only below (1 - margin) x remote's cost
    tpot_target_s: float | None = None  # router.slo_tpot_ms
    max_local_step_share: float = 0.8  # of the TPOT target, a decode step may already take for local prompts
    cache_aware: bool = True  # False: the workers' cached prefixes are not looked at (a cache-blind baseline)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown disaggregation {self.mode!r}; choose one of {', '.join(MODES)}")


@dataclass(frozen=True)
class RemoteOption:
    prefill: PrefillSide
    link: LinkCost  # its cheapest route to a decode worker that can take the request


@dataclass(frozen=True)
class Placement:
    kind: str  # REMOTE, LOCAL or SUFFIX
    reason: str
    prefill: str | None  # the prefill worker (remote), else None
    decode: str | None  # the decode worker (local / suffix); remote leaves it to decode routing
    predicted_ttft_s: float | None = None  # None: nothing measured to predict with

    @property
    def remote(self) -> bool:
        return self.kind == REMOTE


def choose(settings: PlacementSettings, prompt_tokens: int, kv_bytes_per_token: int,
           remotes: Sequence[RemoteOption], locals_: Sequence[DecodeSide], ahead_tokens: int = 0,
           why_no_remote: str = "no_prefill_worker") -> Placement | None:
    """The placement for a prompt of `prompt_tokens`; `remotes`: the prefill workers that could
    take it now (healthy, with a KV route), each with its cheapest link; `locals_`: the healthy
    decode workers; `ahead_tokens`: prompt tokens waiting before it in the router's queue;
    `why_no_remote`: the reason to name when `remotes` is empty. None: no worker can take it."""
    best_local = _best_local(settings, prompt_tokens, locals_)
    if settings.mode == "never":
        return _local(best_local, "never", prompt_tokens) if best_local else None
    if not remotes:
        return _local(best_local, why_no_remote, prompt_tokens) if best_local else None
    if settings.mode == "always" or best_local is None:
        best = min(remotes, key=lambda r: (_remote_cost(r, prompt_tokens, kv_bytes_per_token, ahead_tokens),
                                           r.prefill.worker_id))
        return Placement(REMOTE, "always" if settings.mode == "always" else "no_local", best.prefill.worker_id, None,
                         _remote_ttft(best, prompt_tokens, ahead_tokens))
    if any(r.prefill.tokens_per_s <= 0 for r in remotes) or best_local.tokens_per_s <= 0:
        best = min(remotes, key=lambda r: (r.prefill.queued_tokens, r.prefill.worker_id))
        return Placement(REMOTE, "unmeasured", best.prefill.worker_id, None)
    best = min(remotes, key=lambda r: (_remote_cost(r, prompt_tokens, kv_bytes_per_token, ahead_tokens),
                                       r.prefill.worker_id))
    remote_cost = _remote_cost(best, prompt_tokens, kv_bytes_per_token, ahead_tokens)
    local_cost = _local_cost(settings, best_local, prompt_tokens)
    if local_cost < (1 - settings.margin) * remote_cost:
        waited = best.prefill.queued_tokens + ahead_tokens > 0
        return _local(best_local, "prefill_queue" if waited else "faster", prompt_tokens)
    return Placement(REMOTE, "faster", best.prefill.worker_id, None, _remote_ttft(best, prompt_tokens, ahead_tokens))


def _best_local(settings: PlacementSettings, prompt_tokens: int, decodes: Sequence[DecodeSide]) -> DecodeSide | None:
    allowed = [d for d in decodes if settings.tpot_target_s is None
               or d.decode_step_s <= settings.max_local_step_share * settings.tpot_target_s]
    if not allowed:
        return None
    if any(d.tokens_per_s <= 0 for d in allowed):  # unmeasured: the most cached, then the least busy
        return min(allowed, key=lambda d: (-d.cached_tokens, d.queued_tokens, d.running, d.worker_id))
    return min(allowed, key=lambda d: (_local_cost(settings, d, prompt_tokens), d.worker_id))


def _local(d: DecodeSide, reason: str, prompt_tokens: int) -> Placement:
    kind = SUFFIX if d.cached_tokens > 0 else LOCAL
    ttft = local_ttft_s(d, prompt_tokens) if d.tokens_per_s > 0 else None
    return Placement(kind, reason, None, d.worker_id, ttft)


def _local_cost(settings: PlacementSettings, d: DecodeSide, prompt_tokens: int) -> float:
    return local_ttft_s(d, prompt_tokens) + settings.stall_weight * local_stall_s(d, prompt_tokens) * d.running


def _remote_ttft(r: RemoteOption, prompt_tokens: int, ahead_tokens: int) -> float | None:
    return remote_ttft_s(r.prefill, prompt_tokens, ahead_tokens) if r.prefill.tokens_per_s > 0 else None


def _remote_cost(r: RemoteOption, prompt_tokens: int, kv_bytes_per_token: int, ahead_tokens: int) -> float:
    if r.prefill.tokens_per_s <= 0:
        return float(r.prefill.queued_tokens + ahead_tokens)  # unmeasured: order by queue only
    return remote_ttft_s(r.prefill, prompt_tokens, ahead_tokens) + transfer_s(r.link, prompt_tokens * kv_bytes_per_token)
