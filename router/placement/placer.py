"""One router's placement of requests (disaggregated mode): the glue between what the router
knows now and decide.py's choice, used by each attempt (router/attempt.py) before anything is
sent, and again while it waits for prefill room (a prompt queued behind a busy prefill pool
moves to a decode worker once that is cheaper). It owns the count of prompt tokens placed on
each decode worker and not yet computed there (`local`), every attempt adding and removing its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from router.journey_state import Pool
from router.placement.candidates import decode_sides, local_queue, prefill_sides, prior_rates, remote_options
from router.placement.cost_model import LinkCost
from router.placement.decide import Placement, PlacementSettings, choose
from router.prefill_gate import PrefillGate


class Placer:
    def __init__(self, settings: PlacementSettings, gate: PrefillGate,
                 on_decision: Callable[[str, str, Placement], None] = lambda rid, client_id, placement: None) -> None:
        """`on_decision(request_id, client_id, placement)`: each attempt's final placement (the
        router counts it in pdserve_placement_decisions_total and logs it with the request's ids)."""
        self.settings = settings
        self.gate = gate
        self.on_decision = on_decision
        self.local = local_queue()  # prompt tokens placed on each decode worker, first token not back yet

    def record(self, request_id: str, client_id: str, placement: Placement) -> None:
        self.on_decision(request_id, client_id, placement)

    def place(self, pool: Pool, num_tokens: int, hashes: Sequence[int], ahead_tokens: int) -> Placement | None:
        """Where a prompt of `num_tokens` goes now; `hashes`: its pages as the KV block index
        hashes them (`pool.blocks.prompt_hashes`, once per attempt); `ahead_tokens`: prompt
        tokens waiting before it in the router's prefill queue. None: no worker can take it now."""
        prefill_loads, decode_loads = pool.loads("prefill"), pool.loads("decode")
        cached = pool.blocks.cached_tokens(hashes if self.settings.cache_aware else [],
                                           [w.worker_id for w in (*prefill_loads, *decode_loads)])
        prior_p, prior_d = prior_rates(prefill_loads, decode_loads)
        prefills = prefill_sides(prefill_loads, self.gate.outstanding, cached.__getitem__, prior_p)
        decodes = decode_sides(decode_loads, self.local.tokens, cached.__getitem__, prior_d)

        def link(prefill: str, decode: str) -> LinkCost | None:
            route = pool.kv_route(prefill, decode)
            return None if route is None else pool.link_cost(prefill, route)

        remotes = remote_options(prefills, decodes, link)
        why = "no_prefill_worker" if not prefills else "kv_link_down"
        return choose(self.settings, num_tokens, pool.kv_bytes_per_token(), remotes, decodes, ahead_tokens, why)
