"""Changing a running cluster's pools: `pdserve scale`, the supervisor that replaces dead
workers, and the `pdserve status` report. Runs in the `pdserve up` process, which owns every
actor (cluster/control.py brings the requests in).

Adding a worker: start its actors at the lowest free index (its ports), wait until it is
ready, give every prefill worker the decode workers' KV addresses (cluster/kv_destinations.py),
then tell the router, which routes to it once its heartbeats arrive. Removing one: the
router drains it (no new requests; those it holds finish, up to a timeout), forgets it, then
its actors stop and its placement group is freed. A worker whose actor died (or whose serving
loop ended) is killed and started again at the same index and ports, so the router's endpoint
for it comes back by itself; requests it held were already retried elsewhere (router/journey.py).
"""

from __future__ import annotations

import logging
import threading
import time

from cluster.kv_destinations import share_kv_destinations
from cluster.launcher import RunningCluster, wait_ready
from cluster.specs import ROLES
from cluster.worker_launch import start_worker

log = logging.getLogger(__name__)


class ScaleError(ValueError):
    """A resize that cannot be done; the message says why."""


class PoolManager:
    def __init__(self, cluster: RunningCluster, start_timeout_s: float = 180.0, on_change=None) -> None:
        """`on_change()`: called after the set of workers changed (rewrite the metrics targets)."""
        self.cluster = cluster
        self.start_timeout_s = start_timeout_s
        self.on_change = on_change or (lambda: None)
        self.targets = {role: len(self._indices(role)) for role in ROLES}
        self.autoscaling: dict[str, dict] = {}  # role -> the autoscaler's latest decision (cluster/autoscaler.py)

    def _indices(self, role: str) -> list[int]:
        return sorted(slot.index for slot in self.cluster.slots.values() if slot.role == role)

    # -- scale ----------------------------------------------------------------------------------
    def scale(self, role: str, size: int, drain_timeout_s: float = 60.0, say=log.info) -> dict:
        """Grows or shrinks `role`'s pool to `size` workers; returns what was added and removed."""
        import ray

        config = self.cluster.config
        pool = getattr(config, role, None) if role in ROLES else None
        if pool is None:
            raise ScaleError(f"this cluster has no {role!r} pool (mode {config.mode})")
        if config.kv_transfer.transport == "torch_dist" and role != "colocated":
            raise ScaleError("the torch_dist KV transport joins one fixed process group at start-up; "
                             "pools can be resized with kv_transfer.transport: zmq")
        if not 1 <= size <= pool.worker_limit:
            raise ScaleError(f"{role}: {size} workers is outside 1..{pool.worker_limit} "
                             f"(raise {role}.max_workers in the config to allow more)")
        removed = []
        with self.cluster.lock:
            if self.cluster.closed:
                raise ScaleError("the cluster is shutting down")
            self.targets[role] = size
            indices = self._indices(role)
            try:
                added = self._join(role, self._free_indices(role, size - len(indices)), say)
                starting = self._await_healthy(added, say)
            except BaseException:
                self.targets[role] = len(self._indices(role))  # the supervisor must not keep retrying what failed
                raise
            for i in sorted(indices, reverse=True)[: max(0, len(indices) - size)]:
                slot = self.cluster.slots[f"{role}-{i}"]
                say(f"{slot.worker_id}: draining")
                try:
                    left = ray.get(self.cluster.router.drain_worker.remote(slot.worker_id, drain_timeout_s),
                                   timeout=drain_timeout_s + 30)
                except BaseException:
                    self.targets[role] = len(self._indices(role))  # this one stays: keep the target true
                    raise
                slot.stop()
                del self.cluster.slots[slot.worker_id]
                removed.append({"worker_id": slot.worker_id, "cut_off_requests": left})
            if removed and role == "decode":  # its address is no longer a place for KV
                share_kv_destinations(self.cluster.slots.values(), self.start_timeout_s)
        if added or removed:
            self.on_change()
        return {"role": role, "size": size, "added": added, "removed": removed, "starting": starting}

    # -- supervision ----------------------------------------------------------------------------
    def replace_dead(self, say=log.warning) -> list[str]:
        """Kills every worker whose actor is gone or whose loop has stopped, and starts pools
        back up to their target size (the freed index first, so the same ports)."""
        import ray

        with self.cluster.lock:
            if self.cluster.closed:
                return []
            slots = list(self.cluster.slots.values())
            alive = [slot.actor.alive.remote() for slot in slots]
            for slot, ref in zip(slots, alive):
                try:
                    if ray.get(ref, timeout=30):
                        continue
                    why = "its serving loop stopped"
                except ray.exceptions.GetTimeoutError:
                    continue  # busy (a long step), not dead: the router's heartbeats decide meanwhile
                except ray.exceptions.RayError as exc:
                    why = f"its actor died ({type(exc).__name__})"
                if self.cluster.config.kv_transfer.transport == "torch_dist" and slot.role != "colocated":
                    say(f"{slot.worker_id}: {why}; not replaced (torch_dist KV transport: fixed process group)")
                    continue
                say(f"{slot.worker_id}: {why}; starting a replacement")
                slot.kill()
                del self.cluster.slots[slot.worker_id]
            started = self._restart_missing(say)
        if started:
            self.on_change()
        return started

    def _restart_missing(self, say) -> list[str]:
        """Starts workers until each pool is back at its target size; what fails to start is
        tried again on the next round."""
        started = []
        for role in ROLES:
            missing = self.targets[role] - len(self._indices(role))
            if getattr(self.cluster.config, role, None) is None or missing <= 0:
                continue
            try:
                started += self._join(role, self._free_indices(role, missing), say)
            except Exception as exc:  # noqa: BLE001 - try again on the next round
                say(f"{role}: start failed ({exc}); will retry")
        return started

    def _await_healthy(self, worker_ids: list[str], say, timeout_s: float | None = None) -> list[str]:
        """Waits until the router has a heartbeat from each of `worker_ids` (routes to it), up to
        `timeout_s` (default the router's heartbeat timeout, at least 10 s); returns those still
        starting then. Without it, `pdserve scale` said "added" while status showed the worker DOWN."""
        import ray

        timeout_s = timeout_s if timeout_s is not None else max(10.0, 2 * self.cluster.config.router.heartbeat_timeout_s)
        deadline, waiting = time.monotonic() + timeout_s, list(worker_ids)
        while waiting:
            waiting = [w for w in waiting if not ray.get(self.cluster.router.worker_healthy.remote(w), timeout=30)]
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        for w in worker_ids:
            say(f"{w}: {'still starting (no heartbeat at the router yet)' if w in waiting else 'serving'}")
        return waiting

    def _free_indices(self, role: str, count: int) -> list[int]:
        """The lowest `count` indices (each its own ports) no running worker of `role` has."""
        taken = self._indices(role)
        limit = getattr(self.cluster.config, role).worker_limit
        return [i for i in range(limit) if i not in taken][: max(0, count)]

    def _join(self, role: str, indices: list[int], say) -> list[str]:
        """Starts workers at `indices`, waits until they are ready, tells the router, records
        them. On failure, kills those not yet recorded and raises. Caller holds the lock."""
        import ray

        slots, added = [], []
        try:
            for i in indices:
                slots.append(start_worker(self.cluster.config, role, i, self.start_timeout_s, self.cluster.secret))
            for wid, bound in wait_ready({s.worker_id: s.actor for s in slots}, self.start_timeout_s, say).items():
                next(s for s in slots if s.worker_id == wid).resolve(bound)
            # Before the router routes to them: every prefill worker knows a new decode worker,
            # a new prefill worker knows every decode worker (and a replaced one's new address).
            unreached = share_kv_destinations([*self.cluster.slots.values(), *slots], self.start_timeout_s)
            if new := sorted(set(unreached) & {s.worker_id for s in slots}):
                raise RuntimeError(f"{', '.join(new)} could not be told where the decode workers take KV")
            for s in slots:
                ray.get(self.cluster.router.add_worker.remote(s.endpoint()), timeout=30)  # same or new address
                self.cluster.slots[s.worker_id] = s
                added.append(s.worker_id)
        except BaseException:
            for s in slots:
                if s.worker_id not in added:
                    s.kill()
            raise
        return added

    def supervise(self, stop: threading.Event, every_s: float = 2.0, say=log.warning) -> threading.Thread:
        """Runs `replace_dead` every `every_s` on a thread until `stop` is set."""
        def loop() -> None:
            while not stop.wait(every_s):
                try:
                    self.replace_dead(say)
                except Exception:
                    log.exception("supervisor round failed")

        thread = threading.Thread(target=loop, name="pdserve-supervisor", daemon=True)
        thread.start()
        return thread

    def set_role(self, worker_id: str, role: str, reason: str) -> dict:
        """Flips a switchable worker between prefill and decode (`pdserve role`): the router
        decides where it routes; the worker's pool, and so `scale`, stay as they were."""
        import ray

        flip = ray.get(self.cluster.router.set_role.remote(worker_id, role, reason), timeout=30)
        if "error" in flip:
            raise ScaleError(flip["error"])
        log.info("%s now serves %s (was %s): %s", worker_id, flip["role"], flip["old"], reason)
        return flip

    # -- status ---------------------------------------------------------------------------------
    def status(self) -> dict:
        """Pools, workers (node, placement, health, queue, KV usage) as the router and the actors see them."""
        import ray

        slots = dict(self.cluster.slots)  # a snapshot without the lock: status answers during a long resize
        router = ray.get(self.cluster.router.view.remote(), timeout=30)
        seen = {w["worker_id"]: w for w in router["workers"]}
        states = {}
        for wid, slot in slots.items():
            try:
                states[wid] = ray.get(slot.actor.state.remote(), timeout=10)
            except Exception as exc:  # noqa: BLE001 - shown as the worker's state
                states[wid] = {"error": f"{type(exc).__name__}: {exc}"}
        workers = []
        for wid, slot in sorted(slots.items(), key=lambda kv: (ROLES.index(kv[1].role), kv[1].index)):
            shards = []
            for actor in slot.shards:
                try:
                    shards.append(ray.get(actor.state.remote(), timeout=10))
                except Exception as exc:  # noqa: BLE001
                    shards.append({"error": f"{type(exc).__name__}: {exc}"})
            workers.append({**seen.get(wid, {"worker_id": wid, "role": slot.role}), **states[wid],
                            "placement": None if slot.group is None else slot.group.describe(), "shards": shards})
        pools = {}
        for role in ROLES:
            pool = getattr(self.cluster.config, role, None)
            if pool is not None:
                pools[role] = {"workers": len(self._indices(role)), "target": self.targets[role],
                               "max_workers": pool.worker_limit,
                               "tensor_parallel_size": pool.engine.tensor_parallel_size,
                               "pipeline_parallel_size": pool.engine.pipeline_parallel_size,
                               "autoscaling": self.autoscaling.get(role)}
        nodes = [{"node_id": n["NodeID"], "address": n["NodeManagerAddress"], "alive": n["Alive"],
                  "resources": n.get("Resources", {})} for n in ray.nodes() if n["Alive"]]
        return {"mode": self.cluster.config.mode, "grpc_address": self.cluster.grpc_address, "nodes": nodes,
                "ready": router["ready"], "requests_in_flight": router["in_flight"],
                "recent_p90": router["recent_p90"], "pools": pools,
                "workers": workers, "time": time.time()}
