"""Ray placement for a sharded worker: one placement group, one bundle per TP x PP rank.

Used by `pdserve up` (cluster/launcher.py) before it creates a sharded worker's actors: the
driver (rank 0, the WorkerActor) goes in bundle 0, follower rank r (a ShardActor) in bundle r.
A group that cannot be placed never fails on its own in Ray (it waits for capacity that may
never come), so placement waits with a timeout and then says what was asked and what is free.
"""

from __future__ import annotations

from dataclasses import dataclass

from configs.cluster import PoolConfig


@dataclass
class PlacedGroup:
    worker_id: str
    placement_group: object  # ray.util.placement_group.PlacementGroup

    def strategy(self, rank: int):
        """Scheduling strategy that pins rank `rank`'s actor to its bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=rank)

    def describe(self) -> dict:
        """For `pdserve status`: the group's strategy, bundles and the node of each bundle."""
        from ray.util import placement_group_table

        table = placement_group_table(self.placement_group)
        return {"name": table.get("name"), "strategy": table.get("strategy"), "state": table.get("state"),
                "bundles": list(table.get("bundles", {}).values()),
                "bundle_nodes": list(table.get("bundles_to_node_id", {}).values())}

    def remove(self) -> None:
        from ray.util import remove_placement_group

        remove_placement_group(self.placement_group)


def shard_bundle(pool: PoolConfig) -> dict[str, float]:
    """What one shard (one process) of a worker of `pool` asks Ray for."""
    bundle = {"CPU": pool.num_cpus_per_worker, **pool.resources_per_worker}
    if pool.num_gpus_per_worker:
        bundle["GPU"] = pool.num_gpus_per_worker
    return bundle


def shard_bundles(pool: PoolConfig) -> list[dict[str, float]]:
    return [shard_bundle(pool) for _ in range(pool.engine.world_size)]


def place_worker_group(pool: PoolConfig, worker_id: str, timeout_s: float) -> PlacedGroup:
    """Reserves the bundles of one sharded worker; TimeoutError naming the missing resources."""
    import ray
    from ray.util import placement_group, remove_placement_group

    bundles = shard_bundles(pool)
    pg = placement_group(bundles, strategy=pool.placement_strategy, name=f"pdserve-{worker_id}")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise TimeoutError(
            f"{worker_id}: its {len(bundles)} shards ({bundles[0]} each, {pool.placement_strategy}) could not be "
            f"placed within {timeout_s:.0f} s (available: {ray.available_resources()})") from None
    return PlacedGroup(worker_id, pg)
