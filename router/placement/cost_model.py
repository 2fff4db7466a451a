"""What a placement would cost a request, from measured quantities only: pure functions.

Inputs (router/placement/candidates.py builds them each time a request is placed): each worker's
prefill rate and decode step time (exponential means of its real steps, sent in its heartbeats:
engine/metrics/rates.py), the prompt tokens already queued on it (the router's own counts,
fresher than a heartbeat), the prompt's tokens it already holds in its prefix cache (the KV
block index, router/placement/block_index.py), and each prefill->decode link's latency and
bandwidth (from the tails of real transfers: engine/kv_transfer/link_meter.py).

The two ways a prompt can be computed:
  remote: a prefill worker p computes it after what is queued there, then the KV still in
          flight when its prefill ends crosses the link before decoding starts:
              ttft  = (queued_p + ahead + uncached_p) / rate_p
              start = ttft + latency + tail_bytes / bandwidth
  local:  the decode worker d computes it itself, between its decode steps (chunked prefill):
              ttft  = (queued_d + uncached_d) / rate_d + step_d
              stall = uncached_d / rate_d        (what each request running on d waits meanwhile)
A prompt whose prefix d holds computes only its suffix there (`uncached_d`): that is the
suffix placement. Nothing here guesses a constant for a quantity a worker can measure; where a
worker has not measured one yet, the caller passes a prior from its pool (candidates.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillSide:
    """A prefill worker that could compute the prompt."""

    worker_id: str
    tokens_per_s: float  # its prefill rate (measured, or its pool's prior)
    queued_tokens: int  # prompt tokens sent to it and not prefilled yet
    cached_tokens: int = 0  # of this prompt, already in its prefix cache


@dataclass(frozen=True)
class DecodeSide:
    """A decode worker that could compute the prompt itself (and decodes it either way)."""

    worker_id: str
    tokens_per_s: float  # its own prefill rate (measured, or its pool's prior)
    decode_step_s: float  # its decode step time now (0: not measured)
    queued_tokens: int  # prompt tokens placed on it and not computed yet
    running: int  # sequences in its batch: each waits while it prefills
    cached_tokens: int = 0  # of this prompt, already in its prefix cache


@dataclass(frozen=True)
class LinkCost:
    latency_s: float = 0.0
    bytes_per_s: float = 0.0  # 0: not measured yet (the transfer term is left out)


def uncached(prompt_tokens: int, cached_tokens: int) -> int:
    """Tokens still to compute: at least the last one (its logits give the first token)."""
    return max(1, prompt_tokens - cached_tokens)


def remote_ttft_s(p: PrefillSide, prompt_tokens: int, ahead_tokens: int = 0) -> float:
    """Seconds until p has prefilled the prompt, behind what is queued there and the
    `ahead_tokens` of prompts waiting before it in the router's queue."""
    work = p.queued_tokens + ahead_tokens + uncached(prompt_tokens, p.cached_tokens)
    return work / p.tokens_per_s


def transfer_s(link: LinkCost, tail_bytes: int) -> float:
    """Seconds the KV still in flight after prefill takes to cross the link."""
    if link.bytes_per_s <= 0:
        return link.latency_s
    return link.latency_s + tail_bytes / link.bytes_per_s


def local_ttft_s(d: DecodeSide, prompt_tokens: int) -> float:
    """Seconds until d has computed the prompt itself, behind its own queued prompts."""
    return (d.queued_tokens + uncached(prompt_tokens, d.cached_tokens)) / d.tokens_per_s + d.decode_step_s


def local_stall_s(d: DecodeSide, prompt_tokens: int) -> float:
    """Seconds of d's compute the prompt takes, which each request running on d waits."""
    return uncached(prompt_tokens, d.cached_tokens) / d.tokens_per_s
