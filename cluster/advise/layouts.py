"""The layouts `pdserve advise` compares, read from cluster YAMLs: each pool's workers with the
threads a worker computes on (num_threads_per_worker, else num_cpus_per_worker, at least 1, as
cluster/cpu_priority.py gives them), its token budget and batch bound, and the router's
`disaggregation`. The simulated machine has `cores` cores (default this machine's)."""

from __future__ import annotations

import math
from pathlib import Path

from cluster.advise.simulator import Layout, WorkerShape
from configs import load_cluster_config
from configs.cluster import PoolConfig

ROLES = ("prefill", "decode", "colocated")


def worker_threads(pool: PoolConfig) -> int:
    return pool.num_threads_per_worker or max(1, math.floor(pool.num_cpus_per_worker))


def layout_of(path: str | Path, cores: int) -> Layout:
    config = load_cluster_config(path)
    workers = []
    for role in ROLES:
        pool: PoolConfig | None = getattr(config, role)
        if pool is None:
            continue
        shape = WorkerShape(role, worker_threads(pool), pool.engine.max_num_batched_tokens, pool.engine.max_num_seqs,
                            pool.engine.page_size)
        workers += [shape] * pool.num_workers
    return Layout(Path(path).stem, tuple(workers), cores, config.router.disaggregation)
