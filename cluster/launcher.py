"""`pdserve up`: YAML -> Ray -> worker actors -> router actor -> healthy, and back down.

Starts an embedded local Ray (or joins `ray.address`), creates one actor per worker and the
router, waits for each with a timeout and a progress display, and names what failed and why.
The cluster lives as long as the `up` process: Ctrl-C (or `pdserve down`, which signals it)
stops every actor and the embedded Ray, leaving no process behind. While it runs, the run dir
holds its state and a Prometheus file_sd list of its /metrics targets (router and workers).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from cluster.placement import PlacedGroup, place_worker_group
from configs import ClusterConfig

RUN_DIR_ENV = "PDSERVE_RUN_DIR"


def run_dir() -> Path:
    return Path(os.environ.get(RUN_DIR_ENV, Path.home() / ".cache" / "pdserve" / "run"))


def state_file(config_path: str | Path) -> Path:
    """Where `up` records its pid and router address, keyed by the config file."""
    key = str(Path(config_path).resolve()).replace(os.sep, "_").strip("_")
    return run_dir() / f"{key}.json"


@dataclass
class RunningCluster:
    config: ClusterConfig
    router: object  # RouterActor handle
    workers: dict[str, object]  # worker_id -> WorkerActor handle
    grpc_address: str
    owns_ray: bool
    shards: dict[str, list[object]] = field(default_factory=dict)  # worker_id -> ShardActor handles (ranks 1..)
    groups: dict[str, PlacedGroup] = field(default_factory=dict)  # worker_id -> its placement group

    def page_stats(self) -> dict[str, dict[str, int]]:
        import ray

        return dict(zip(self.workers, ray.get([w.page_stats.remote() for w in self.workers.values()])))

    def shutdown(self) -> None:
        import ray

        for actor in [self.router, *self.workers.values()]:
            try:
                ray.get(actor.stop.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - the actor may already be gone; kill regardless
                pass
            ray.kill(actor)
        _release_groups(self.shards, self.groups)
        if self.owns_ray:
            ray.shutdown()


def _init_ray(config: ClusterConfig) -> bool:
    import ray

    if ray.is_initialized():
        return False
    if config.ray.address:
        ray.init(address=config.ray.address, namespace=config.ray.namespace, log_to_driver=False)
        return False
    # Keep the embedded cluster on loopback (DESIGN.md section 5) and never join a stale one.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(address="local", namespace=config.ray.namespace, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    return True


def up(config: ClusterConfig, timeout_s: float = 180.0, say=print) -> RunningCluster:
    import ray

    from cluster.actors import RouterActor, WorkerActor
    from cluster.shard_actor import ShardActor

    owns_ray = _init_ray(config)
    host = config.router.host if config.router.host != "0.0.0.0" else "127.0.0.1"
    event_address = f"{host}:{config.router.worker_event_port}"
    workers: dict[str, object] = {}
    shards: dict[str, list[object]] = {}
    groups: dict[str, PlacedGroup] = {}
    endpoints = []
    ranks = config.kv_dist_ranks()
    try:
        for role in ("prefill", "decode", "colocated"):
            pool = getattr(config, role)
            if pool is None:
                continue
            engine = config.engine_config(pool).model_dump()
            for i in range(pool.num_workers):
                worker_id = f"{role}-{i}"
                kv = {"kv_port": pool.kv_base_port + i if role == "decode" else None,
                      "kv_checksum": config.kv_transfer.checksum, "kv_transport": config.kv_transfer.transport}
                if config.kv_transfer.transport == "torch_dist" and role != "colocated":
                    kv.update(dist_rank=ranks[worker_id], dist_world_size=len(ranks),
                              dist_store_address=f"{host}:{config.kv_transfer.dist_port}")
                metrics = None
                if pool.metrics_base_port is not None:
                    metrics = {"port": pool.metrics_base_port + i, "peak_tflops": pool.peak_tflops,
                               "peak_memory_bandwidth_gbps": pool.peak_memory_bandwidth_gbps}
                placement = {}
                if pool.engine.world_size > 1:  # rank 0 here, ranks 1.. as ShardActors, one bundle each
                    groups[worker_id] = place_worker_group(pool, worker_id, timeout_s)
                    kv["shard_store_address"] = f"{host}:{pool.shard_base_port + i}"
                    placement = {"scheduling_strategy": groups[worker_id].strategy(0)}
                    shards[worker_id] = [ShardActor.options(
                        name=f"pdserve-{worker_id}-rank{rank}", num_cpus=pool.num_cpus_per_worker,
                        num_gpus=pool.num_gpus_per_worker, scheduling_strategy=groups[worker_id].strategy(rank),
                    ).remote(worker_id, rank, engine, kv["shard_store_address"]) for rank in range(1, pool.engine.world_size)]
                workers[worker_id] = WorkerActor.options(
                    name=f"pdserve-{worker_id}", num_cpus=pool.num_cpus_per_worker, num_gpus=pool.num_gpus_per_worker,
                    **placement,
                ).remote(role, worker_id, engine, host, pool.base_port + i, event_address, kv, metrics,
                         config.logging.model_dump())
                endpoints.append({"worker_id": worker_id, "role": role, "command_address": f"{host}:{pool.base_port + i}"})
        _wait(workers, "ready", timeout_s, say)
        router_kwargs = {
            "endpoints": endpoints, "event_address": f"{config.router.host}:{config.router.worker_event_port}",
            "mode": config.mode, "policy": config.router.policy,
            "max_queued_requests": config.router.max_queued_requests,
            "kv_timeout_s": config.kv_transfer.timeout_s, "lease_s": config.kv_transfer.reservation_lease_s,
            "slo_ttft_ms": config.router.slo_ttft_ms, "slo_tpot_ms": config.router.slo_tpot_ms,
            "slo_window_s": config.router.slo_window_s,
        }
        router = RouterActor.options(name="pdserve-router", num_cpus=0).remote(
            config.model, None, router_kwargs, config.router.host, config.router.grpc_port, config.router.http_port,
            config.logging.model_dump())
        deadline = time.monotonic() + timeout_s
        say("router: waiting for every worker's heartbeat ...")
        while not ray.get(router.ready.remote(), timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError("router: workers did not report healthy in time")
            time.sleep(0.2)
        say(f"router: serving gRPC on {host}:{config.router.grpc_port}"
            + (f", OpenAI-compatible HTTP on {host}:{config.router.http_port}" if config.router.http_port else ""))
    except BaseException:
        for actor in workers.values():
            ray.kill(actor)
        _release_groups(shards, groups)
        if owns_ray:
            ray.shutdown()
        raise
    return RunningCluster(config, router, workers, f"{host}:{config.router.grpc_port}", owns_ray, shards, groups)


def _release_groups(shards: dict[str, list[object]], groups: dict[str, PlacedGroup]) -> None:
    """Ends follower ranks (after their driver sent STOP, or not) and frees their bundles."""
    import ray

    for actors in shards.values():
        for actor in actors:
            ray.kill(actor)
    for group in groups.values():
        group.remove()


def _wait(actors: dict[str, object], method: str, timeout_s: float, say) -> None:
    """Waits for every actor's `method`, naming the ones that failed or never got placed."""
    import ray

    pending = {getattr(actor, method).remote(): name for name, actor in actors.items()}
    deadline = time.monotonic() + timeout_s
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            missing = sorted(pending.values())
            raise TimeoutError(
                f"{', '.join(missing)} did not start within {timeout_s:.0f} s: the cluster may lack the "
                f"resources they ask for (available: {ray.available_resources()})")
        name = pending.pop(done[0])
        try:
            ray.get(done[0])
        except Exception as exc:  # noqa: BLE001 - reported with the worker's name
            raise RuntimeError(f"{name} failed to start: {exc}") from exc
        say(f"{name}: ready")


def write_state(config_path: str | Path, cluster: RunningCluster) -> Path:
    path = state_file(config_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pid": os.getpid(), "grpc_address": cluster.grpc_address}))
    return path


def metrics_targets(config: ClusterConfig) -> list[dict]:
    """Prometheus file_sd entries: the router's HTTP port (its /metrics) and every worker's
    metrics port, each labelled with what it is."""
    host = config.router.host if config.router.host != "0.0.0.0" else "127.0.0.1"
    targets = []
    if config.router.http_port is not None:
        targets.append({"targets": [f"{host}:{config.router.http_port}"],
                        "labels": {"job": "pdserve-router", "component": "router"}})
    for role in ("prefill", "decode", "colocated"):
        pool = getattr(config, role)
        if pool is None or pool.metrics_base_port is None:
            continue
        for i in range(pool.num_workers):
            targets.append({"targets": [f"{host}:{pool.metrics_base_port + i}"],
                            "labels": {"job": "pdserve-worker", "component": role}})
    return targets


def write_metrics_targets(config_path: str | Path, config: ClusterConfig) -> Path:
    """Writes `metrics_targets` where a Prometheus `file_sd_configs` entry can watch it."""
    path = state_file(config_path).with_suffix(".prometheus.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(metrics_targets(config), indent=1))
    return path


def read_state(config_path: str | Path) -> dict | None:
    path = state_file(config_path)
    return json.loads(path.read_text()) if path.is_file() else None
