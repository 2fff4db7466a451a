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
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from cluster.kv_destinations import share_kv_destinations
from cluster.specs import model_cache_dir, router_spec
from cluster.worker_launch import WorkerSlot, start_worker, worker_host
from configs import ClusterConfig
from proto.frame_auth import ClusterSecret
from router.security import FrontDoorSecurity

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
    slots: dict[str, WorkerSlot]  # worker_id -> its actors; changed by cluster/pools.py under `lock`
    grpc_address: str
    owns_ray: bool
    secret: ClusterSecret = field(repr=False)  # every worker the pools start later gets it too
    lock: threading.RLock = field(default_factory=threading.RLock)
    closed: bool = False  # set by shutdown: the supervisor and autoscaler start nothing after it

    @property
    def workers(self) -> dict[str, object]:
        """worker_id -> WorkerActor handle."""
        return {wid: slot.actor for wid, slot in self.slots.items()}

    def page_stats(self) -> dict[str, dict[str, int]]:
        import ray

        with self.lock:
            workers = self.workers
        return dict(zip(workers, ray.get([w.page_stats.remote() for w in workers.values()])))

    def shutdown(self) -> None:
        import ray

        with self.lock:
            self.closed = True
            try:
                ray.get(self.router.stop.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - the actor may already be gone; kill regardless
                pass
            ray.kill(self.router)
            for slot in self.slots.values():
                slot.stop()
            self.slots.clear()
        if self.owns_ray:
            ray.shutdown()


def _init_ray(config: ClusterConfig) -> bool:
    import ray

    if ray.is_initialized():
        return False
    if config.ray.address:
        ray.init(address=config.ray.address, namespace=config.ray.namespace, log_to_driver=False)
        return False
    # Keep the embedded cluster on loopback (docs/design.md §5) and never join a stale one.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(address="local", namespace=config.ray.namespace, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    return True


def up(config: ClusterConfig, timeout_s: float = 180.0, say=print, secret: ClusterSecret | None = None) -> RunningCluster:
    """`secret`: the cluster's (cluster/cluster_secret.py); None = the operator's, else a new one."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from cluster.actors import RouterActor
    from engine.model.loader import resolve_model_path

    # The API key and TLS files, read and checked before anything starts (an unset variable fails here).
    security = FrontDoorSecurity.load(config.router)
    if secret is None:
        from cluster.cluster_secret import resolve

        secret, _ = resolve(config)
    owns_ray = _init_ray(config)
    host = worker_host(config)
    slots: dict[str, WorkerSlot] = {}
    router = None
    try:
        # The checkpoint is resolved (a built-in one built, once, before any worker looks for it)
        # here, on the node the router is pinned to, so the router process never loads torch.
        model_dir = resolve_model_path(config.model, model_cache_dir(config))
        for role in ("prefill", "decode", "colocated"):
            pool = getattr(config, role)
            for i in range(pool.num_workers if pool is not None else 0):
                slot = start_worker(config, role, i, timeout_s, secret)
                slots[slot.worker_id] = slot
        for wid, bound in wait_ready({wid: slot.actor for wid, slot in slots.items()}, timeout_s, say).items():
            slots[wid].resolve(bound)
        # Before the router exists: a prefill worker accepts KV destinations only among these.
        unreached = share_kv_destinations(slots.values(), timeout_s)
        if unreached:
            raise RuntimeError(f"{', '.join(unreached)} could not be told where the decode workers take KV")
        # The event socket binds the internal address, never a public 0.0.0.0.
        spec = router_spec(config, str(model_dir), [slot.endpoint() for slot in slots.values()], host, secret,
                           security)
        # Pinned to this node: router.host (or, for 0.0.0.0, this node's IP) is where clients and
        # workers find it. Several calls at once: a drain waits on the router while status reads it.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        router = RouterActor.options(name="pdserve-router", num_cpus=0, max_concurrency=8,
                                     scheduling_strategy=here).remote(spec, config.logging)
        deadline = time.monotonic() + timeout_s
        say("router: waiting for every worker's heartbeat ...")
        while not ray.get(router.ready.remote(), timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError("router: workers did not report healthy in time")
            time.sleep(0.2)
        r = config.router
        guard = ", ".join([*(["TLS"] if r.wants_tls else []), *(["API key"] if r.wants_api_key else [])])
        say(f"router: serving gRPC on {host}:{r.grpc_port}"
            + (f", OpenAI-compatible HTTP on {host}:{r.http_port}" if r.http_port else "")
            + (f" ({guard})" if guard else ""))
    except BaseException:
        if router is not None:  # on a joined Ray cluster a named router left behind blocks the next `up`
            ray.kill(router)
        for slot in slots.values():
            slot.kill()
        if owns_ray:
            ray.shutdown()
        raise
    return RunningCluster(config, router, slots, f"{host}:{config.router.grpc_port}", owns_ray, secret)


def wait_ready(actors: dict[str, object], timeout_s: float, say) -> dict[str, object]:
    """Waits for every actor's `ready`, naming the ones that failed or never got placed;
    returns each one's reply."""
    import ray

    pending = {actor.ready.remote(): name for name, actor in actors.items()}
    replies = {}
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
            replies[name] = ray.get(done[0])
        except Exception as exc:
            raise RuntimeError(f"{name} failed to start: {exc}") from exc
        say(f"{name}: ready")
    return replies


def write_state(config_path: str | Path, cluster: RunningCluster) -> Path:
    path = state_file(config_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    control = f"{worker_host(cluster.config)}:{cluster.config.router.control_port}"
    path.write_text(json.dumps({"pid": os.getpid(), "grpc_address": cluster.grpc_address, "control_address": control}))
    return path


def metrics_targets(config: ClusterConfig, workers: list[tuple[str, int]] | None = None) -> list[dict]:
    """Prometheus file_sd entries: the router's HTTP port (its /metrics, unless router.http_metrics
    is off) and every worker's metrics port, each labelled with what it is. `workers`: (role,
    index) of the running workers; None = those the config starts with. With router.api_key*
    set, the scrape job needs the key (`authorization: {credentials_file: ...}`)."""
    host = worker_host(config)
    if workers is None:
        workers = [(role, i) for role in ("prefill", "decode", "colocated") if getattr(config, role) is not None
                   for i in range(getattr(config, role).num_workers)]
    targets = []
    r = config.router
    if r.http_port is not None and r.http_metrics:
        # __scheme__: file_sd's way to say a target is scraped over https (router.tls_cert_file).
        labels = {"job": "pdserve-router", "component": "router", **({"__scheme__": "https"} if r.wants_tls else {})}
        targets.append({"targets": [f"{host}:{r.http_port}"], "labels": labels})
    roles = ("prefill", "decode", "colocated")
    for role, i in sorted(workers, key=lambda w: (roles.index(w[0]), w[1])):
        pool = getattr(config, role)
        if pool.metrics_base_port is not None:
            targets.append({"targets": [f"{host}:{pool.metrics_base_port + i}"],
                            "labels": {"job": "pdserve-worker", "component": role, "worker_id": f"{role}-{i}"}})
    return targets


def write_metrics_targets(config_path: str | Path, config: ClusterConfig,
                          workers: list[tuple[str, int]] | None = None) -> Path:
    """Writes `metrics_targets` where a Prometheus `file_sd_configs` entry can watch it (again
    after every resize: Prometheus re-reads the file)."""
    path = state_file(config_path).with_suffix(".prometheus.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(metrics_targets(config, workers), indent=1))
    tmp.replace(path)  # atomic: a scraper never reads half a file
    return path


def read_state(config_path: str | Path) -> dict | None:
    path = state_file(config_path)
    return json.loads(path.read_text()) if path.is_file() else None
