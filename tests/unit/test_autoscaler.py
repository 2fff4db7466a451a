"""The autoscaling controller's decisions (cluster/autoscaler.py) on given signals: load and
latency targets, clamping, the scale-down delay, the latency cooldown, and the absolute
capacity request it hands the Ray autoscaler. The pools it resizes are a recording twin."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.autoscaler import Autoscaler, PoolSignals, desired_size
from configs.cluster import AutoscalingConfig, ClusterConfig

DECODE = AutoscalingConfig(min_workers=1, max_workers=3, target_kv_usage=0.5, target_tpot_ms=100,
                           scale_down_delay_s=10, cooldown_s=5)
PREFILL = AutoscalingConfig(min_workers=1, max_workers=2, target_queued_tokens_per_worker=1000, target_ttft_ms=500)


@pytest.mark.parametrize(("signals", "expected"), [
    (PoolSignals(workers=1, kv_used_pages=0, kv_pages_per_worker=64), 1),  # idle: the minimum
    (PoolSignals(workers=1, kv_used_pages=32, kv_pages_per_worker=64), 1),  # exactly at target
    (PoolSignals(workers=1, kv_used_pages=33, kv_pages_per_worker=64), 2),
    (PoolSignals(workers=2, kv_used_pages=500, kv_pages_per_worker=64), 3),  # clamped to max
    (PoolSignals(workers=1, kv_used_pages=5, kv_pages_per_worker=64, tpot_p90_s=0.2), 2),  # TPOT breach: one more
    (PoolSignals(workers=3, kv_used_pages=5, kv_pages_per_worker=64, tpot_p90_s=0.2), 3),
])
def test_decode_size_from_kv_usage_and_tpot(signals, expected):
    assert desired_size("decode", DECODE, signals)[0] == expected


def test_prefill_size_from_queued_tokens_and_ttft():
    assert desired_size("prefill", PREFILL, PoolSignals(workers=1, queued_tokens=1500))[0] == 2
    size, why = desired_size("prefill", PREFILL, PoolSignals(workers=1, queued_tokens=10, ttft_p90_s=0.9))
    assert size == 2 and "p90 TTFT 900 ms over its 500 ms target" in why
    # During the cooldown after a resize the latency window still holds the old, slow requests.
    assert desired_size("prefill", PREFILL, PoolSignals(workers=1, ttft_p90_s=0.9), latency_ok_to_act=False)[0] == 1


class Pools:
    """A recording twin of PoolManager: serves `status` from the signals a test sets."""

    def __init__(self, config: ClusterConfig) -> None:
        self.cluster = SimpleNamespace(config=config)
        self.targets = {"prefill": 1, "decode": 1, "colocated": 0}
        self.autoscaling: dict[str, dict] = {}
        self.used_pages = 0
        self.resized: list[tuple[str, int]] = []

    def status(self) -> dict:
        workers = [{"role": "prefill", "queued_tokens": 0, "kv_pages": {"referenced": 0, "num_pages": 64}}]
        workers += [{"role": "decode", "queued_tokens": 0,
                     "kv_pages": {"referenced": self.used_pages // self.targets["decode"], "num_pages": 64}}
                    for _ in range(self.targets["decode"])]
        return {"workers": workers, "recent_p90": {"requests": 0, "ttft_s": None, "tpot_s": None}}

    def scale(self, role, size, say=None):
        self.resized.append((role, size))
        self.targets[role] = size
        return {"role": role, "size": size}


def test_grows_at_once_shrinks_after_the_delay_and_asks_ray_for_every_bundle():
    config = ClusterConfig.model_validate({
        "model": "builtin:tiny",
        "prefill": {"base_port": 53000, "num_cpus_per_worker": 0.5},
        "decode": {"base_port": 53100, "kv_base_port": 53200, "num_cpus_per_worker": 0.5,
                   "resources_per_worker": {"decode_slot": 1.0},
                   "autoscaling": {"min_workers": 1, "max_workers": 2, "target_kv_usage": 0.5,
                                   "scale_down_delay_s": 10}}})
    pools, now, requests = Pools(config), [0.0], []
    scaler = Autoscaler(pools, clock=lambda: now[0], request_resources=requests.append, say=lambda line: None)
    pools.used_pages = 50  # 50 of 64 pages: over the 50% target
    scaler.step()
    assert pools.resized == [("decode", 2)]
    assert requests[-1] == [{"CPU": 0.5}, {"CPU": 0.5, "decode_slot": 1.0}, {"CPU": 0.5, "decode_slot": 1.0}]
    assert pools.autoscaling["decode"]["wanted"] == 2 and "50 KV pages in use" in pools.autoscaling["decode"]["why"]
    pools.used_pages = 0
    for t in (1.0, 5.0, 10.5):  # below target from t=1: not yet removed at t=10.5 (9.5 s)
        now[0] = t
        scaler.step()
    assert pools.resized == [("decode", 2)]
    now[0] = 11.0
    scaler.step()
    assert pools.resized == [("decode", 2), ("decode", 1)]
    assert requests[-1] == [{"CPU": 0.5}, {"CPU": 0.5, "decode_slot": 1.0}]  # the extra node may go
    now[0] = 30.0
    scaler.step()  # at the minimum: stays
    assert pools.resized == [("decode", 2), ("decode", 1)]
