"""Starting and ending one worker's Ray actors: what `pdserve up` does for each worker at start,
`pdserve scale` for each worker it adds, and the supervisor for each worker it replaces.

Worker `<role>-<i>` always takes the ports of index i (base_port + i, kv_base_port + i, ...),
so a replacement on the same node comes back at the address the router already knows.
Addresses: with a loopback router.host everything stays on this machine's loopback; otherwise
each worker binds its own node's IP (a worker may land on any node) and reports its command
address when ready, and workers push events to router.host (or, for 0.0.0.0, the address of
the node the `up` process runs on, where the router is pinned). A TP x PP worker is a
placement group (cluster/placement.py): the WorkerActor (rank 0) in bundle 0, a ShardActor per
follower rank after it. `WorkerSlot.kill` ends all of it and frees the bundles; it is the one
owner of those resources.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from cluster.placement import PlacedGroup, place_worker_group
from cluster.specs import NODE_IP, WorkerSpec, worker_spec
from configs import ClusterConfig
from proto.frame_auth import ClusterSecret
from router.worker_pool import WorkerEndpoint


@dataclass
class WorkerSlot:
    worker_id: str
    role: str
    index: int
    actor: object  # WorkerActor handle
    command_address: str
    shards: list[object] = field(default_factory=list)  # ShardActor handles, ranks 1..
    group: PlacedGroup | None = None
    bound: WorkerSpec | None = None  # its spec with the host it bound, once it is ready

    def resolve(self, ready_reply: WorkerSpec) -> None:
        """What the worker bound, from its `ready()` reply (its node's IP off loopback): the
        command address the router sends to, the KV address a decode worker takes KV on."""
        self.bound = ready_reply
        self.command_address = ready_reply.command_address

    def endpoint(self) -> WorkerEndpoint:
        """What the router is told of this worker, once it is ready (`resolve`): the addresses it bound."""
        if self.bound is None:
            raise RuntimeError(f"worker {self.worker_id} has not reported ready: its addresses are not known yet")
        return endpoint_of(self.bound, self.command_address)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Asks the worker to stop its loop (its followers leave theirs), then kills everything."""
        import ray

        try:
            ray.get(self.actor.stop.remote(), timeout=timeout_s)
        except Exception:  # noqa: BLE001 - the actor may already be gone; kill regardless
            pass
        self.kill()

    def kill(self) -> None:
        import ray

        for actor in [self.actor, *self.shards]:
            if actor is not None:
                ray.kill(actor)
        if self.group is not None:
            self.group.remove()
            self.group = None


def endpoint_of(spec: WorkerSpec, command_address: str | None = None) -> WorkerEndpoint:
    """The router's view of a worker started with `spec` (the addresses it bound)."""
    return WorkerEndpoint(spec.worker_id, spec.role, command_address or spec.command_address, spec.kv_address,
                          spec.kv_fallback_address, spec.kv_source, spec.switchable)


def worker_host(config: ClusterConfig) -> str:
    """Where workers reach the router's internal sockets (events, control) and what those bind:
    router.internal_host if set, else router.host unless that is 0.0.0.0, else loopback for an
    embedded cluster or this node's address; never the wildcard."""
    if config.router.internal_host is not None:
        return config.router.internal_host
    if config.router.host != "0.0.0.0":
        return config.router.host
    if on_loopback(config):
        return "127.0.0.1"
    import ray

    return ray.util.get_node_ip_address()  # the `up` process's node, where the router is pinned


def on_loopback(config: ClusterConfig) -> bool:
    """A one-machine cluster: every socket on 127.0.0.1 (embedded Ray, or fake nodes)."""
    return config.router.host.startswith("127.") or config.router.host == "localhost" or (
        config.router.host == "0.0.0.0" and config.ray.address is None)


def _bundle_node_ip(group: PlacedGroup) -> str:
    """The IP of the node holding bundle 0 (rank 0, whose process opens the shard store)."""
    import ray
    from ray.util import placement_group_table

    node_id = placement_group_table(group.placement_group)["bundles_to_node_id"][0]
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)


def start_worker(config: ClusterConfig, role: str, index: int, timeout_s: float, secret: ClusterSecret) -> WorkerSlot:
    """Creates worker `<role>-<index>`'s actors (placing its group first); does not wait for
    them to be ready (the caller waits, with its own progress and timeout). `secret`: the
    cluster's, inside the spec the actor is constructed with."""
    from cluster.actors import WorkerActor
    from cluster.shard_actor import ShardActor

    pool = getattr(config, role)
    router_host = worker_host(config)
    spec = worker_spec(config, role, index, router_host if on_loopback(config) else NODE_IP, router_host, secret)
    placement, shards, group = {}, [], None
    try:
        if pool.engine.world_size > 1:  # rank 0 here, ranks 1.. as ShardActors, one bundle each
            group = place_worker_group(pool, spec.worker_id, timeout_s)
            store_host = spec.host if spec.host != NODE_IP else _bundle_node_ip(group)
            spec = replace(spec, shard_store_address=f"{store_host}:{pool.shard_base_port + index}")
            placement = {"scheduling_strategy": group.strategy(0)}
            for rank in range(1, pool.engine.world_size):
                shards.append(ShardActor.options(
                    name=f"pdserve-{spec.worker_id}-rank{rank}", num_cpus=pool.num_cpus_per_worker,
                    num_gpus=pool.num_gpus_per_worker, resources=dict(pool.resources_per_worker),
                    scheduling_strategy=group.strategy(rank),
                ).remote(spec.worker_id, rank, spec.engine, spec.shard_store_address))
        actor = WorkerActor.options(
            name=f"pdserve-{spec.worker_id}", num_cpus=pool.num_cpus_per_worker, num_gpus=pool.num_gpus_per_worker,
            resources=dict(pool.resources_per_worker), **placement,
        ).remote(spec, config.logging)
    except BaseException:
        WorkerSlot(spec.worker_id, role, index, None, "", shards, group).kill()  # what was made so far
        raise
    return WorkerSlot(spec.worker_id, role, index, actor, spec.command_address, shards, group)
