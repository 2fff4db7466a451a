"""Keeping every prefill worker's KV destinations current: the KV addresses of the cluster's
decode workers, as the `up` process knows them (each decode worker reports the address it bound
when it is ready), handed to each prefill worker through its Ray actor, never over the router's
command socket, which any peer that reaches it can write to (engine/kv_transfer/destinations.py).

Called, with the cluster's lock held, whenever the set of workers changes and before the router
learns of a new worker: at `up` (cluster/launcher.py), when workers join (scaled up, autoscaled
or replaced) and after some are removed (cluster/pools.py). So no request is routed to a decode
worker its prefill worker does not know, and a new prefill worker knows every decode worker
before its first request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from cluster.specs import kv_destinations
from cluster.worker_launch import WorkerSlot

log = logging.getLogger(__name__)


def share_kv_destinations(slots: Iterable[WorkerSlot], timeout_s: float = 30.0) -> list[str]:
    """Tells every prefill worker among `slots` the KV addresses of every ready decode worker
    among them (the whole set: one that left is dropped). Returns the prefill workers that could
    not be told (gone or stuck): each caller decides what that means for it."""
    import ray

    slots = list(slots)
    addresses = kv_destinations(slot.bound for slot in slots if slot.bound is not None)
    # Ray handles of every worker that sends KV: prefill workers, and switchable ones whatever their pool.
    actors: dict[str, Any] = {slot.worker_id: slot.actor for slot in slots
                              if slot.role == "prefill" or (slot.bound is not None and slot.bound.switchable)}
    pending = {worker_id: actor.set_kv_destinations.remote(addresses) for worker_id, actor in actors.items()}
    deadline = time.monotonic() + timeout_s
    unreached = []
    for worker_id, ref in pending.items():
        try:
            ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - a dead prefill worker is the supervisor's to replace
            log.warning("%s: could not be told the decode workers' KV addresses: %s: %s", worker_id,
                        type(exc).__name__, exc)
            unreached.append(worker_id)
    return unreached
