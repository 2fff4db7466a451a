"""The one place a cluster YAML becomes what each process is started with.

`ClusterConfig` (configs/cluster.py) describes the whole cluster; a router is started with a
`RouterSpec` (router/spec.py) and each worker with a `WorkerSpec` (below), both frozen and built
here, by the Ray launcher (cluster/launcher.py, cluster/worker_launch.py) and the in-process test
cluster (tests/local_cluster.py) alike. A setting added to the YAML travels through these
objects to every process that needs it; nothing crosses a process boundary as a `**kwargs` dict.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from configs import ClusterConfig, EngineConfig
from configs.cluster import PoolConfig
from configs.flight_recorder import FlightRecorderConfig
from proto.frame_auth import ClusterSecret
from router.security import FrontDoorSecurity
from router.spec import RouterSpec
from router.worker_pool import WorkerEndpoint

ROLES = ("prefill", "decode", "colocated")
NODE_IP = "node"  # a worker binds the IP of the node Ray put it on (resolved by WorkerActor)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one worker process (rank 0 of its shard group) is started with."""

    role: str  # "prefill", "decode" or "colocated"
    worker_id: str  # "<role>-<index>"
    engine: EngineConfig
    host: str  # the address it binds: an IP, or NODE_IP ("node": the node Ray put it on)
    command_port: int  # router commands arrive here
    router_event_address: str  # host:port of the router's event socket
    # Signs and checks every message on the worker's sockets (proto/frame_auth.py); repr hidden.
    cluster_secret: ClusterSecret = field(repr=False)
    kv_port: int | None = None  # decode with the zmq transport: KV frames arrive here
    kv_transport: str = "zmq"  # "zmq" or "torch_dist" (kv_transfer.transport)
    kv_checksum: bool = False
    # torch_dist: this worker's rank in the KV process group, its size, and the group's store.
    dist_rank: int | None = None
    dist_world_size: int | None = None
    dist_store_address: str | None = None
    dist_sources: tuple[int, ...] = ()  # decode: the prefill ranks its KV comes from (NCCL names each source)
    dist_sinks: tuple[int, ...] = ()  # prefill: the decode ranks it may send to (a heartbeat keeps each link)
    dist_timeout_s: float = 120.0  # kv_transfer.dist_timeout_s: the group's bound on every send and receive
    link_heartbeat_s: float = 5.0  # kv_transfer.link_heartbeat_s: an idle KV link's heartbeat
    shard_store_address: str | None = None  # TP x PP > 1: the store its follower ranks join
    # What the router may ask for: a larger lease or transfer deadline in a message is cut to these
    # (kv_transfer.reservation_lease_s / timeout_s), so no peer can hold pages indefinitely.
    max_lease_s: float = 30.0
    max_transfer_s: float = 30.0
    metrics_port: int | None = None  # serve /metrics here; None = no metrics
    num_threads: int | None = None  # pool.num_threads_per_worker: torch's intra-op threads; None = Ray's default
    nice: int = 0  # pool.nice: this worker's niceness (cluster/cpu_priority.py)
    peak_tflops: float | None = None  # what MFU / MBU are measured against (None = measured at start)
    peak_memory_bandwidth_gbps: float | None = None
    flight: FlightRecorderConfig = field(default_factory=FlightRecorderConfig)  # the YAML's flight_recorder
    # router.role_switching on: this worker can flip between prefill and decode at run time
    # (cluster/role_switch/), so whatever its pool it binds a KV receiver on kv_port and keeps KV
    # links to the cluster's other switchable workers.
    switchable: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown worker role {self.role!r}; choose one of {ROLES}")
        if self.kv_transport not in ("zmq", "torch_dist"):
            raise ValueError(f"unknown KV transport {self.kv_transport!r}; choose 'zmq' or 'torch_dist'")
        if self.role == "decode" and self.kv_transport == "zmq" and self.kv_port is None:
            raise ValueError("a decode worker needs a kv_port to receive KV on")
        if self.switchable and (self.role == "colocated" or self.kv_transport != "zmq" or self.kv_port is None):
            raise ValueError("a switchable worker is a prefill or decode worker with the zmq KV transport and a "
                             "kv_port")
        dist = (self.dist_rank, self.dist_world_size, self.dist_store_address)
        if self.kv_transport == "torch_dist" and self.role != "colocated" and None in dist:
            raise ValueError("the torch_dist KV transport needs dist_rank, dist_world_size and dist_store_address")

    @property
    def command_address(self) -> str:
        return f"{self.host}:{self.command_port}"

    @property
    def kv_address(self) -> str | None:
        """Where a decode worker takes KV, as its Reserved replies name it: host:kv_port, or
        `dist:<rank>` on the torch_dist transport (engine/kv_transfer/torch_dist.py address_of,
        spelt out here: building specs must not import torch). A switchable worker has one
        whatever its role. None for other roles."""
        if self.role != "decode" and not self.switchable:
            return None
        if self.kv_transport == "torch_dist":
            return f"dist:{self.dist_rank}"
        return f"{self.host}:{self.kv_port}"

    @property
    def kv_fallback_address(self) -> str | None:
        """Where a decode worker on the torch_dist transport also takes KV over ZMQ
        (host:kv_port): the pairs whose torch.distributed link died send there. None otherwise."""
        if self.role != "decode" or self.kv_transport != "torch_dist" or self.kv_port is None:
            return None
        return f"{self.host}:{self.kv_port}"

    @property
    def kv_source(self) -> str | None:
        """A prefill worker's name as a torch_dist decode worker's receiver knows it (`dist:<rank>`;
        a link it can no longer hear is reported under it). None off torch_dist."""
        if self.role != "prefill" or self.kv_transport != "torch_dist":
            return None
        return f"dist:{self.dist_rank}"


def kv_destinations(specs: Iterable[WorkerSpec]) -> tuple[str, ...]:
    """The KV addresses of the decode (and switchable) workers among `specs` (each with the host it bound), with
    their ZMQ fallbacks on torch_dist: the only places a prefill worker of the cluster may push
    KV to (engine/kv_transfer/destinations.py)."""
    return tuple(sorted({address for spec in specs for address in (spec.kv_address, spec.kv_fallback_address)
                         if address is not None}))


def serving_pools(config: ClusterConfig) -> list[tuple[str, PoolConfig]]:
    """(role, pool) of every pool the mode runs, in start order."""
    return [(role, pool) for role in ROLES if (pool := getattr(config, role)) is not None]


def worker_spec(config: ClusterConfig, role: str, index: int, host: str, router_host: str,
                secret: ClusterSecret) -> WorkerSpec:
    """Worker `<role>-<index>`: it takes the ports of index i (base_port + i, kv_base_port + i, ...),
    so a replacement comes back where the router already knows it. `host`: the address it binds;
    `router_host`: where the router (and, for torch_dist, the KV group's store) listens; `secret`:
    the cluster's (cluster/cluster_secret.py), the same for every process of the cluster."""
    pool: PoolConfig = getattr(config, role)
    worker_id = f"{role}-{index}"
    kv = config.kv_transfer
    rank = world_size = store = None
    sources: tuple[int, ...] = ()
    sinks: tuple[int, ...] = ()
    if kv.transport == "torch_dist" and role != "colocated":
        ranks = config.kv_dist_ranks()
        rank, world_size, store = ranks[worker_id], len(ranks), f"{router_host}:{kv.dist_port}"
        if role == "decode":
            sources = tuple(r for name, r in ranks.items() if name.startswith("prefill-"))
        else:
            sinks = tuple(r for name, r in ranks.items() if name.startswith("decode-"))
    return WorkerSpec(
        role=role, worker_id=worker_id, engine=config.engine_config(pool), host=host,
        command_port=pool.base_port + index,
        router_event_address=f"{router_host}:{config.router.worker_event_port}", cluster_secret=secret,
        kv_port=pool.kv_base_port + index if (role == "decode" or config.switchable) and pool.kv_base_port is not None
        else None, switchable=config.switchable,
        kv_transport=kv.transport, kv_checksum=kv.checksum,
        dist_rank=rank, dist_world_size=world_size, dist_store_address=store, dist_sources=sources,
        dist_sinks=sinks, dist_timeout_s=kv.dist_timeout_s, link_heartbeat_s=kv.link_heartbeat_s,
        max_lease_s=kv.reservation_lease_s, max_transfer_s=kv.timeout_s,
        shard_store_address=None,  # placed groups learn their store's node first (worker_launch.py)
        metrics_port=pool.metrics_base_port + index if pool.metrics_base_port is not None else None,
        peak_tflops=pool.peak_tflops, peak_memory_bandwidth_gbps=pool.peak_memory_bandwidth_gbps,
        num_threads=pool.num_threads_per_worker, nice=pool.nice, flight=config.flight_recorder)


def router_spec(config: ClusterConfig, model_dir: str, endpoints: list[WorkerEndpoint], router_host: str,
                secret: ClusterSecret, security: FrontDoorSecurity | None = None,
                default_timeout_s: float = 600.0) -> RouterSpec:
    """The router of `config`, serving the checkpoint at `model_dir` (see `model_cache_dir`) with
    workers at `endpoints`; its event socket binds `router_host`:router.worker_event_port and
    takes only events signed under `secret`.
    `security`: the API key and TLS files already loaded from config.router; None = load them here."""
    limits = [pool.engine.max_model_len for _, pool in serving_pools(config) if pool.engine.max_model_len]
    page_size = serving_pools(config)[-1][1].engine.page_size  # decode's or colocated's (prefill's is equal)
    return RouterSpec(
        model_dir=str(model_dir), model_name=config.model, mode=config.mode, endpoints=tuple(endpoints),
        event_address=f"{router_host}:{config.router.worker_event_port}", cluster_secret=secret, router=config.router,
        kv_timeout_s=config.kv_transfer.timeout_s, lease_s=config.kv_transfer.reservation_lease_s,
        max_model_len=min(limits) if limits else None, default_timeout_s=default_timeout_s, page_size=page_size,
        security=FrontDoorSecurity.load(config.router) if security is None else security,
        flight=config.flight_recorder)


def model_cache_dir(config: ClusterConfig) -> str | None:
    """Where the router finds a built-in model: the engines' `cache_dir` (the first pool's; a
    built-in model is built byte-identically wherever it is built)."""
    return next((pool.engine.cache_dir for _, pool in serving_pools(config) if pool.engine.cache_dir), None)
