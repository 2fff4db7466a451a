"""Spawning the ranks of a torch.distributed group for a test: one process per rank, a queue for
what they report, each joined (or killed) at the end. Used by the gloo transport tests
(tests/integration/test_torch_dist_transport.py) and the NCCL one (tests/gpu/test_gpu_nccl.py)."""

from __future__ import annotations

import multiprocessing as mp
import queue

import pytest

from tests.local_cluster import free_port

SPAWN = mp.get_context("spawn")


def run_ranks(target, world: int, num_results: int, silence: str, *extra,
              timeout_s: float = 90) -> tuple[list, list[int | None]]:
    """Spawns `target(rank, port, results, *extra)` for each rank of a torch.distributed group (gloo or NCCL); returns the
    first `num_results` things the ranks put on `results`, and the ranks' exit codes."""
    results = SPAWN.Queue()
    port = free_port()
    procs = [SPAWN.Process(target=target, args=(rank, port, results, *extra)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=timeout_s) for _ in range(num_results)]
    except queue.Empty:
        pytest.fail(silence)
    finally:
        for p in procs:
            p.join(timeout_s / 3)
            if p.is_alive():
                p.kill()
    return got, [p.exitcode for p in procs]
