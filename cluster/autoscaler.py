"""The autoscaling controller: resizes each pool that has an `autoscaling:` section from live
signals, and asks the Ray autoscaler for the nodes those workers need.

Runs on a thread of the `pdserve up` process beside the supervisor. Every `interval_s` it reads
the router's view (queued prompt tokens per prefill worker, recent TTFT/TPOT p90) and each
decode worker's KV pages, decides each pool's size with `desired_size` (a pure function), and
resizes through PoolManager.scale (new workers join once healthy; removed ones are drained, so
no request fails). Growth happens at once; shrinking only after the load has stayed below
target for `scale_down_delay_s`, one worker at a time, so a burst does not flap the pool.

Capacity: before a resize the controller sets `ray.autoscaler.sdk.request_resources` to the
bundles of every worker the pools should have, all pools together (the request is absolute).
On a Ray cluster started from a cluster-launcher YAML (configs/ray/aws-prefill-decode.yaml), the
Ray autoscaler then adds nodes of the type that offers the pool's custom resource
(`resources_per_worker`, e.g. decode_slot) and, once the request shrinks and a node idles,
removes it. A worker created before its node exists waits as a pending actor, which the Ray
autoscaler also counts as demand.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass

from cluster.placement import shard_bundles
from cluster.pools import ROLES, PoolManager
from configs.cluster import AutoscalingConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolSignals:
    workers: int  # serving now (not draining)
    queued_tokens: int = 0  # prefill: prompt tokens accepted and not yet prefilled, all workers
    kv_used_pages: int = 0  # decode: pages in use, all workers
    kv_pages_per_worker: int = 0
    ttft_p90_s: float | None = None
    tpot_p90_s: float | None = None


def desired_size(role: str, cfg: AutoscalingConfig, s: PoolSignals, latency_ok_to_act: bool = True
                 ) -> tuple[int, str]:
    """How many workers `role`'s pool should have, and why (clamped to min..max)."""
    if role == "decode":
        capacity = cfg.target_kv_usage * max(1, s.kv_pages_per_worker)
        want = math.ceil(s.kv_used_pages / capacity) if s.kv_used_pages else 0
        why = f"{s.kv_used_pages} KV pages in use, target {cfg.target_kv_usage:.0%} of {s.kv_pages_per_worker} per worker"
        latency, target, name = s.tpot_p90_s, cfg.target_tpot_ms, "TPOT"
    else:
        want = math.ceil(s.queued_tokens / cfg.target_queued_tokens_per_worker)
        why = f"{s.queued_tokens} prompt tokens queued, target {cfg.target_queued_tokens_per_worker} per worker"
        latency, target, name = s.ttft_p90_s, cfg.target_ttft_ms, "TTFT"
    if latency_ok_to_act and target is not None and latency is not None and latency * 1000 > target:
        want = max(want, s.workers + 1)
        why += f"; p90 {name} {latency * 1000:.0f} ms over its {target:.0f} ms target"
    return min(cfg.max_workers, max(cfg.min_workers, want)), why


class Autoscaler:
    def __init__(self, pools: PoolManager, clock=time.monotonic, request_resources=None, say=log.info) -> None:
        """`request_resources(bundles)`: how capacity is asked for (default: the Ray
        autoscaler SDK; tests may pass their own); `say`: where resizes are reported."""
        self.pools = pools
        self.say = say
        self.clock = clock
        self._request = request_resources or _ray_request_resources
        self._below_since: dict[str, float] = {}
        self._last_change: dict[str, float] = {}
        self.decisions = pools.autoscaling  # role -> the latest decision (shown by `pdserve status`)

    @property
    def configs(self) -> dict[str, AutoscalingConfig]:
        config = self.pools.cluster.config
        return {role: getattr(config, role).autoscaling for role in ROLES
                if getattr(config, role) is not None and getattr(config, role).autoscaling is not None}

    def signals(self) -> dict[str, PoolSignals]:
        status = self.pools.status()
        recent = status["recent_p90"]
        out = {}
        for role in self.configs:
            workers = [w for w in status["workers"] if w.get("role") == role and not w.get("draining")]
            pages = [w["kv_pages"] for w in workers if w.get("kv_pages")]
            out[role] = PoolSignals(
                workers=len(workers), queued_tokens=sum(w.get("queued_tokens") or 0 for w in workers),
                kv_used_pages=sum(p["referenced"] for p in pages),
                kv_pages_per_worker=max((p["num_pages"] for p in pages), default=0),
                ttft_p90_s=recent["ttft_s"], tpot_p90_s=recent["tpot_s"])
        return out

    def step(self) -> list[dict]:
        """One round: read signals, decide, resize. Returns the resizes made."""
        now = self.clock()
        changes = []
        signals = self.signals()
        wanted = {}
        for role, cfg in self.configs.items():
            s = signals[role]
            calm = now - self._last_change.get(role, -math.inf) >= cfg.cooldown_s
            size, why = desired_size(role, cfg, s, latency_ok_to_act=calm)
            current = self.pools.targets[role]
            if size < current:
                since = self._below_since.setdefault(role, now)
                size = current - 1 if now - since >= cfg.scale_down_delay_s else current
            else:
                self._below_since.pop(role, None)
            wanted[role] = size
            self.decisions[role] = {"workers": s.workers, "target": current, "wanted": size, "why": why}
        self._request(self._bundles(wanted))
        for role, size in wanted.items():
            if size != self.pools.targets[role]:
                self.say(f"autoscaler: {role} {self.pools.targets[role]} -> {size} workers "
                         f"({self.decisions[role]['why']})")
                changes.append(self.pools.scale(role, size, say=self.say))
                self._last_change[role] = self.clock()
                self._below_since.pop(role, None)
        return changes

    def _bundles(self, wanted: dict[str, int]) -> list[dict[str, float]]:
        """Every worker's bundles the pools should have (absolute: what the cluster must fit)."""
        config = self.pools.cluster.config
        bundles = []
        for role in ROLES:
            pool = getattr(config, role)
            if pool is not None:
                size = wanted.get(role, self.pools.targets[role])
                bundles += [b for _ in range(size) for b in shard_bundles(pool)]
        return bundles

    def run(self, stop: threading.Event) -> threading.Thread:
        """Rounds every min(interval_s) on a thread until `stop`; clears the capacity request at the end."""
        every = min(cfg.interval_s for cfg in self.configs.values())

        def loop() -> None:
            try:
                while not stop.wait(every):
                    try:
                        self.step()
                    except Exception:
                        log.exception("autoscaler round failed")
            finally:
                try:
                    self._request([])
                except Exception:  # noqa: BLE001 - Ray may already be shutting down
                    pass

        thread = threading.Thread(target=loop, name="pdserve-autoscaler", daemon=True)
        thread.start()
        return thread


def _ray_request_resources(bundles: list[dict[str, float]]) -> None:
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=bundles)
