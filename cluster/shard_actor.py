"""The Ray actor of one follower rank (1..TP x PP - 1) of a sharded worker.

`pdserve up` creates one per follower rank in the worker's placement group
(cluster/placement.py), next to the WorkerActor that is rank 0. The actor only hosts
engine.parallel.shard_follower.run_follower on a thread: it joins the worker's process group, loads
its shard and executes the driver's commands until the driver sends STOP.
"""

from __future__ import annotations

import threading

import ray

from cluster.gc_policy import tune_for_serving
from configs import EngineConfig


@ray.remote
class ShardActor:
    def __init__(self, worker_id: str, rank: int, config: EngineConfig, store_address: str) -> None:
        from engine.parallel.shard_follower import run_follower

        tune_for_serving()  # a follower steps with its driver: the same collector setting
        self.worker_id, self.rank = worker_id, rank
        self.error: str | None = None

        def run() -> None:
            try:
                run_follower(config, rank, store_address)
            except BaseException as exc:  # noqa: BLE001 - reported through `state`
                self.error = f"{type(exc).__name__}: {exc}"

        self._thread = threading.Thread(target=run, name=f"pdserve-{worker_id}-rank{rank}", daemon=True)
        self._thread.start()

    def state(self) -> dict:
        """For `pdserve status`: where this rank runs and whether it still serves."""
        return {"worker_id": self.worker_id, "rank": self.rank, "node_id": ray.get_runtime_context().get_node_id(),
                "alive": self._thread.is_alive(), "error": self.error}
