"""The follower ranks of a tensor/pipeline-parallel worker, and a local group for offline use.

`run_follower` is a follower rank's whole life: join the group, load its shard, execute the
driver's commands until STOP (engine/parallel/shard_executor.py). Under `pdserve up` each follower is
a Ray actor in the worker's placement group (cluster/actors.py); `start_local_group` runs
them as local subprocesses instead, for `LLM(...)` and tests.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from dataclasses import dataclass

from configs.engine import EngineConfig
from engine.model.loader import resolve_model_path
from engine.parallel.layout import ShardGroup, ShardLayout
from engine.parallel.model_shard import load_shard
from engine.parallel.shard_executor import follower_loop

log = logging.getLogger(__name__)


def group_backend(config: EngineConfig) -> str:
    return "nccl" if config.device.startswith("cuda") else "gloo"


def run_follower(config: EngineConfig, rank: int, store_address: str, timeout_s: float = 120.0) -> None:
    layout = ShardLayout(config.tensor_parallel_size, config.pipeline_parallel_size, rank)
    if not 0 < rank < layout.world_size:
        raise ValueError(f"follower rank {rank} outside 1..{layout.world_size - 1}")
    group = ShardGroup.join(layout, store_address, group_backend(config), timeout_s)
    try:
        shard = load_shard(config, resolve_model_path(config.model, config.cache_dir), layout, group)
        follower_loop(group, shard.model, shard.kv_cache)
    finally:
        group.close()


@dataclass
class LocalGroup:
    """The driver's side of a local group: pass `group` to LLMEngine, `stop()` afterwards."""

    group: ShardGroup
    processes: list[multiprocessing.Process]

    def stop(self, timeout_s: float = 30.0) -> None:
        """Waits for the followers to leave (after the engine's close()), then ends stragglers."""
        deadline = time.monotonic() + timeout_s
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)


def start_local_group(config: EngineConfig, host: str = "127.0.0.1", timeout_s: float = 120.0) -> LocalGroup:
    """Starts ranks 1..world-1 as subprocesses and joins as rank 0; the store takes a free port
    (these processes never leave this machine, so no configured port is needed)."""
    layout = ShardLayout(config.tensor_parallel_size, config.pipeline_parallel_size, 0)
    store = ShardGroup.open_store(layout, f"{host}:0", timeout_s)
    ctx = multiprocessing.get_context("spawn")  # never fork a process that holds torch threads
    processes = [ctx.Process(target=_follower_main, name=f"pdserve-shard-{rank}", daemon=True,
                             args=(config.model_dump_json(), rank, f"{host}:{store.port}", timeout_s, os.getpid()))
                 for rank in range(1, layout.world_size)]
    for p in processes:
        p.start()
    try:
        group = ShardGroup(layout, store, group_backend(config), timeout_s)
    except BaseException:
        LocalGroup(None, processes).stop(timeout_s=0)
        raise
    return LocalGroup(group, processes)


def _follower_main(config_json: str, rank: int, store_address: str, timeout_s: float, parent_pid: int) -> None:
    # A follower must not outlive its driver's process, even one that was SIGKILLed.
    def watch_parent() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch_parent, daemon=True).start()
    run_follower(EngineConfig.model_validate_json(config_json), rank, store_address, timeout_s)
