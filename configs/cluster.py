"""The cluster a user launches from one YAML file: model, router, worker pools, KV transfer, Ray.

Read by the composition root (cluster/) when `pdserve up CONFIG.yaml` runs; every process gets
its part of this tree. Strict and frozen: an unknown key, a wrong type or an impossible
combination fails at load with the key's dotted path named (`load_cluster_config`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from configs.engine import EngineConfig, EngineSettings
from configs.flight_recorder import FlightRecorderConfig
from configs.logging_setup import LoggingConfig
from configs.role_switching import RoleSwitchingConfig


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class PlacementConfig(_Strict):
    """How `disaggregation: adaptive` weighs a prompt computed on a decode worker against a prefill
    worker's (router/placement/decide.py, with the cost model's terms)."""

    stall_weight: float = Field(0.5, ge=0, description="what a second of stall on each request running on the "
                                "decode worker counts against a second of TTFT")
    margin: float = Field(0.2, ge=0, lt=1, description="a local placement must cost less than (1 - margin) "
                          "of the remote one")
    max_local_step_share: float = Field(0.8, gt=0, le=1, description="a decode worker whose decode step already "
                                        "takes this share of slo_tpot_ms takes no local prompts")
    cache_aware: bool = Field(True, description="weigh each worker's cached prefix of the prompt (KV block events); "
                              "false: a cache-blind baseline for benchmarks (with policy: least_loaded)")


class RouterConfig(_Strict):
    host: str = "127.0.0.1"
    grpc_port: int = Field(50051, ge=1, le=65535)
    http_port: int | None = Field(None, ge=1, le=65535, description="OpenAI-compatible HTTP; None = off")
    max_queued_requests: int = Field(256, ge=1, description="admission bound: beyond it, RESOURCE_EXHAUSTED")
    max_queued_prompt_tokens: int = Field(
        1 << 20, ge=1, description="admission bound on the prompt tokens of requests in flight: beyond it, RESOURCE_EXHAUSTED")
    policy: Literal["least_loaded", "prefix_affinity"] = "prefix_affinity"
    # Where each request's prompt is computed in mode disaggregated (router/placement/): always
    # on a prefill worker (a decode worker only when no prefill worker can take it), never (on
    # the decode worker itself), or adaptive (whichever the measured costs say is cheaper).
    disaggregation: Literal["always", "adaptive", "never"] = "adaptive"
    placement: PlacementConfig = PlacementConfig()
    # Workers that flip between prefill and decode at run time (router/role_switch/); off by default.
    role_switching: RoleSwitchingConfig = RoleSwitchingConfig()
    worker_event_port: int = Field(52000, ge=1, le=65535, description="workers push events to the router here")
    # Where the internal sockets (worker events, control) bind: never the public `host` when that is
    # 0.0.0.0. None = `host` when it names one interface, else this node's address (loopback for
    # an embedded Ray cluster).
    internal_host: str | None = None
    # Live goodput (router /metrics): a request counts when it meets every target that is set.
    slo_ttft_ms: float | None = Field(None, gt=0, description="time-to-first-token target; None = no target")
    slo_tpot_ms: float | None = Field(None, gt=0, description="time-per-output-token target; None = no target")
    slo_window_s: float = Field(60.0, gt=0, description="SLO attainment gauge covers requests finished this recently")
    # SLO-aware admission (router/slo_admission.py): refuse at once (RESOURCE_EXHAUSTED / HTTP 429
    # with Retry-After) a request whose predicted TTFT is past this many times slo_ttft_ms.
    slo_admission_factor: float | None = Field(None, ge=1, description="refuse requests predicted past this "
                                               "multiple of slo_ttft_ms; None = admit every request")
    # Failures: a worker silent this long is dead to the router; a request it held is retried.
    heartbeat_timeout_s: float = Field(3.0, gt=0, description="no heartbeat this long = the worker is dead")
    max_attempts: int = Field(3, ge=1, description="tries per request when workers die under it (1 = no retry)")
    retry_wait_s: float = Field(10.0, ge=0, description="a retry waits this long for a healthy worker to appear")
    # Disaggregated: prompts wait in the router (holding no pages) until a prefill worker has
    # fewer than this many prompt tokens sent to it and not yet prefilled, so decode reservations'
    # leases only cover a short prefill queue (router/prefill_gate.py).
    max_prefill_queue_tokens: int = Field(8192, ge=1, description="prompt tokens queued on one prefill worker at most")
    # Request limits, each answered with INVALID_ARGUMENT naming the limit before any work.
    max_prompt_bytes: int = Field(1 << 20, ge=1, description="prompt text, in UTF-8 bytes, before tokenizing")
    max_stop_strings: int = Field(16, ge=0, description="stop strings per request")
    max_stop_string_chars: int = Field(256, ge=1, description="characters of one stop string")
    max_stop_token_ids: int = Field(64, ge=0, description="stop token ids per request")
    max_request_id_chars: int = Field(128, ge=1, description="a client request id: printable ASCII, no spaces")
    max_timeout_s: float = Field(3600.0, gt=0, description="the longest timeout_s a request may ask for")
    # On cores it shares with workers (one node), the router yields to their compute
    # (cluster/cpu_priority.py has why and the figures).
    nice: int = Field(10, ge=0, le=19, description="the router process's niceness; 0 = leave it as started")
    control_port: int = Field(52001, ge=1, le=65535,
                              description="the `up` process answers `pdserve status` / `pdserve scale` here")
    # The public doors' own protection (README "Security"; router/security.py). An API key, from at
    # most one source, is asked of every call but health checks; SecretStr keeps it out of every repr.
    api_key: SecretStr | None = Field(None, description="the key itself; prefer api_key_env or api_key_file")
    api_key_env: str | None = Field(None, min_length=1, description="environment variable of `pdserve up` "
                                    "holding the API key")
    api_key_file: str | None = Field(None, min_length=1, description="file holding the API key (whitespace "
                                     "around it ignored)")
    tls_cert_file: str | None = Field(None, min_length=1, description="PEM certificate chain: gRPC and HTTP "
                                      "serve TLS (with tls_key_file)")
    tls_key_file: str | None = Field(None, min_length=1, description="PEM private key of tls_cert_file")
    grpc_reflection: bool = Field(True, description="serve gRPC server reflection (asks for the API key when set)")
    http_metrics: bool = Field(True, description="serve Prometheus /metrics on http_port (asks for the API key "
                               "when set)")

    @property
    def wants_api_key(self) -> bool:
        return any(v is not None for v in (self.api_key, self.api_key_env, self.api_key_file))

    @property
    def wants_tls(self) -> bool:
        return self.tls_cert_file is not None

    @model_validator(mode="after")
    def _check_slo_admission(self) -> RouterConfig:
        if self.slo_admission_factor is not None and self.slo_ttft_ms is None:
            raise ValueError("slo_admission_factor needs slo_ttft_ms: the TTFT target it is a multiple of")
        if self.role_switching.mode == "auto" and (self.slo_ttft_ms is None or self.slo_tpot_ms is None):
            raise ValueError("role_switching.mode auto needs slo_ttft_ms and slo_tpot_ms: the controller flips "
                             "a worker when one of them is under pressure and the other has slack")
        return self

    @model_validator(mode="after")
    def _check_security(self) -> RouterConfig:
        sources = [name for name in ("api_key", "api_key_env", "api_key_file") if getattr(self, name) is not None]
        if len(sources) > 1:
            raise ValueError(f"give the API key one way, not {' and '.join(sources)}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            given, missing = ("tls_cert_file", "tls_key_file") if self.tls_key_file is None else \
                ("tls_key_file", "tls_cert_file")
            raise ValueError(f"{given} needs {missing}: TLS takes a certificate and its private key")
        return self


class AutoscalingConfig(_Strict):
    """Resize one pool from live signals (cluster/autoscaler.py): prefill from queued prompt
    tokens and TTFT, decode from KV page usage and TPOT. Latency targets are p90s over the
    router's slo_window_s; a breach adds a worker even when the load signal does not."""

    min_workers: int = Field(1, ge=1)
    max_workers: int = Field(ge=1)
    target_queued_tokens_per_worker: int = Field(4096, ge=1, description="prefill: prompt tokens waiting per worker")
    target_kv_usage: float = Field(0.7, gt=0, le=1, description="decode: share of KV pages in use per worker")
    target_ttft_ms: float | None = Field(None, gt=0, description="prefill: p90 TTFT above this adds a worker")
    target_tpot_ms: float | None = Field(None, gt=0, description="decode: p90 TPOT above this adds a worker")
    interval_s: float = Field(2.0, gt=0, description="how often signals are read")
    scale_down_delay_s: float = Field(60.0, ge=0, description="load must stay below target this long to remove one")
    cooldown_s: float = Field(30.0, ge=0, description="after a resize, latency breaches wait this long (stale window)")

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingConfig:
        if self.max_workers < self.min_workers:
            raise ValueError(f"max_workers ({self.max_workers}) is below min_workers ({self.min_workers})")
        return self


class PoolConfig(_Strict):
    num_workers: int = Field(1, ge=1, description="workers at start; the supervisor replaces dead ones to keep the count")
    max_workers: int | None = Field(
        None, ge=1, description="`pdserve scale` may grow the pool to this many (ports reserved); None = num_workers")
    # Per process: a worker with engine.tensor_parallel_size x pipeline_parallel_size shards
    # asks this much for each shard (one placement-group bundle per shard).
    num_cpus_per_worker: float = Field(1.0, gt=0, description="CPUs per worker process (per shard)")
    num_gpus_per_worker: float = Field(0.0, ge=0, description="GPUs per worker process (per shard)")
    # Why a worker may run more compute threads than the CPUs Ray reserves for it: a 1P1D pair
    # on two cores leaves one core idle whenever its partner is (the decode core between steps,
    # the prefill core with no prompt queued). Two threads each, with the prefill pool at a higher
    # niceness, let a prompt use both cores while decode steps still run first (docs/operations.md).
    num_threads_per_worker: int | None = Field(
        None, ge=1, description="compute threads per worker process; None = num_cpus_per_worker (at least 1). "
        "More than its CPUs oversubscribes the cores on purpose (see nice)")
    nice: int = Field(0, ge=0, le=19, description="the pool's worker processes' niceness; a higher value lets "
                      "another pool's compute on shared cores run first (0 = leave it)")
    resources_per_worker: dict[str, float] = Field(
        default_factory=dict, description="Ray custom resources per shard (e.g. {decode_slot: 1}: ties the pool to "
        "node types that offer them, so the Ray autoscaler knows which node type to add)")
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK", description="Ray placement of a sharded worker's bundles")
    shard_base_port: int | None = Field(
        None, ge=1, le=65535, description="sharded worker i's process-group store listens on shard_base_port + i")
    base_port: int = Field(ge=1, le=65535, description="worker i takes router commands on base_port + i")
    kv_base_port: int | None = Field(
        None, ge=1, le=65535, description="decode worker i receives KV on kv_base_port + i (decode pools, and "
        "prefill pools whose workers can flip to decode: router.role_switching)"
    )
    metrics_base_port: int | None = Field(
        None, ge=1, le=65535, description="worker i serves Prometheus /metrics on metrics_base_port + i; None = off")
    # Peaks that MBU / MFU are measured against; None = a rough measurement at start-up.
    peak_memory_bandwidth_gbps: float | None = Field(None, gt=0, description="GB/s (1e9 bytes) per worker")
    peak_tflops: float | None = Field(None, gt=0, description="dense TFLOP/s per worker, in the engine's dtype")
    engine: EngineSettings = EngineSettings()
    autoscaling: AutoscalingConfig | None = None

    @property
    def worker_limit(self) -> int:
        """The most workers this pool may have (ports are reserved for that many)."""
        limits = [self.num_workers, self.max_workers or 0, self.autoscaling.max_workers if self.autoscaling else 0]
        return max(limits)

    @model_validator(mode="after")
    def _check_sharding(self) -> PoolConfig:
        if self.max_workers is not None and self.max_workers < self.num_workers:
            raise ValueError(f"max_workers ({self.max_workers}) is below num_workers ({self.num_workers})")
        a = self.autoscaling
        if a is not None and not a.min_workers <= self.num_workers <= a.max_workers:
            raise ValueError(f"num_workers ({self.num_workers}) is outside autoscaling's "
                             f"{a.min_workers}..{a.max_workers}")
        if a is not None and self.max_workers is not None and a.max_workers > self.max_workers:
            raise ValueError(f"autoscaling.max_workers ({a.max_workers}) is above max_workers ({self.max_workers})")
        e = self.engine
        if e.world_size > 1 and self.shard_base_port is None:
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {e.world_size} needs shard_base_port: "
                             "each sharded worker's ranks meet on a process-group store there")
        if e.tensor_parallel_size > 1 and self.placement_strategy in ("SPREAD", "STRICT_SPREAD"):
            raise ValueError(f"placement_strategy {self.placement_strategy} with tensor_parallel_size > 1: "
                             "tensor-parallel shards all-reduce in every layer, keep them on one node "
                             "(STRICT_PACK or PACK)")
        return self


class KVTransferConfig(_Strict):
    transport: Literal["zmq", "torch_dist"] = "zmq"
    timeout_s: float = Field(30.0, gt=0, description="deadline of one transfer")
    reservation_lease_s: float = Field(30.0, gt=0, description="decode pages wait this long for their KV")
    # CRC-32 of every page frame, sent by prefill and required by decode: corrupt KV fails its transfer
    # (and the request is retried) instead of decoding from garbage.
    checksum: bool = True
    dist_port: int = Field(52500, ge=1, le=65535, description="torch_dist: the process group's TCP store port")
    # torch_dist: every send and receive of the group is bounded by this, and a receive that runs
    # past it ends that link for good (engine/kv_transfer/torch_dist.py), so idle links carry a
    # heartbeat every link_heartbeat_s (kept to at most a third of it). On ZMQ links the same
    # interval paces ZMTP pings, which find a decode worker that vanished without a goodbye.
    dist_timeout_s: float = Field(120.0, gt=0, description="torch_dist: the process group's timeout")
    link_heartbeat_s: float = Field(5.0, gt=0, description="an idle KV link carries a heartbeat this often")

    @model_validator(mode="after")
    def _check_heartbeat(self) -> KVTransferConfig:
        if self.link_heartbeat_s * 3 > self.dist_timeout_s:
            raise ValueError(f"link_heartbeat_s ({self.link_heartbeat_s:g}) must be at most a third of "
                             f"dist_timeout_s ({self.dist_timeout_s:g}): an idle torch_dist link would time out")
        return self


class RayConfig(_Strict):
    address: str | None = Field(None, description="existing cluster ('auto' or host:port); None = embedded")
    namespace: str = "pdserve"


class ClusterConfig(_Strict):
    model: str
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    router: RouterConfig = RouterConfig()
    prefill: PoolConfig | None = None
    decode: PoolConfig | None = None
    colocated: PoolConfig | None = None
    kv_transfer: KVTransferConfig = KVTransferConfig()
    ray: RayConfig = RayConfig()
    logging: LoggingConfig = LoggingConfig()
    flight_recorder: FlightRecorderConfig = FlightRecorderConfig()
    # The key every internal message is signed with (README "Security"): a path, never the secret
    # itself. None = $PDSERVE_CLUSTER_SECRET, else one made by `pdserve up` (cluster/cluster_secret.py).
    cluster_secret_file: str | None = Field(None, min_length=1, description="file holding the cluster's secret "
                                            "(multi-host clusters whose processes start apart); None = generated")

    @model_validator(mode="after")
    def _check_combination(self) -> ClusterConfig:
        if self.mode == "disaggregated":
            if self.prefill is None or self.decode is None:
                raise ValueError("mode 'disaggregated' needs both 'prefill' and 'decode' pools")
            if self.colocated is not None:
                raise ValueError("'colocated' pool given in mode 'disaggregated': remove it or set mode: colocated")
            if self.decode.kv_base_port is None:
                raise ValueError("decode.kv_base_port is required: decode workers receive KV there")
            if self.prefill.engine.page_size != self.decode.engine.page_size:
                raise ValueError("prefill.engine.page_size and decode.engine.page_size must be equal: "
                                 "KV moves page by page")
            if self.prefill.engine.dtype != self.decode.engine.dtype:
                raise ValueError("prefill.engine.dtype and decode.engine.dtype must be equal: KV bytes are copied")
            if self.switchable:
                if self.kv_transfer.transport != "zmq":
                    raise ValueError("router.role_switching needs kv_transfer.transport: zmq (a torch_dist group "
                                     "fixes which ranks send and which receive)")
                if self.prefill.kv_base_port is None:
                    raise ValueError("router.role_switching needs prefill.kv_base_port: a prefill worker "
                                     "receives KV there once it flips to decode")
        else:
            if self.colocated is None:
                raise ValueError("mode 'colocated' needs a 'colocated' pool")
            if self.prefill is not None or self.decode is not None:
                raise ValueError("'prefill'/'decode' pools given in mode 'colocated': set mode: disaggregated")
        if self.kv_transfer.transport == "torch_dist" and any(
                p is not None and p.autoscaling is not None for p in (self.prefill, self.decode)):
            raise ValueError("autoscaling needs kv_transfer.transport: zmq (a torch_dist group has a fixed membership)")
        self._check_ports()
        return self

    @property
    def switchable(self) -> bool:
        """Whether the workers can flip between prefill and decode (router.role_switching)."""
        return self.mode == "disaggregated" and self.router.role_switching.mode != "off"

    def kv_dist_ranks(self) -> dict[str, int]:
        """torch_dist: each prefill and decode worker's rank in the KV process group."""
        names = [f"{role}-{i}" for role in ("prefill", "decode") if getattr(self, role) is not None
                 for i in range(getattr(self, role).num_workers)]
        return {name: rank for rank, name in enumerate(names)}

    def _check_ports(self) -> None:
        used: dict[int, str] = {self.router.grpc_port: "router.grpc_port"}
        if self.router.worker_event_port in used:
            raise ValueError(f"router.worker_event_port {self.router.worker_event_port} is also router.grpc_port")
        used[self.router.worker_event_port] = "router.worker_event_port"
        if self.router.control_port in used:
            raise ValueError(f"router.control_port {self.router.control_port} is also {used[self.router.control_port]}")
        used[self.router.control_port] = "router.control_port"
        if self.mode == "disaggregated" and self.kv_transfer.transport == "torch_dist":
            if self.kv_transfer.dist_port in used:
                raise ValueError(f"kv_transfer.dist_port {self.kv_transfer.dist_port} is also "
                                 f"{used[self.kv_transfer.dist_port]}")
            used[self.kv_transfer.dist_port] = "kv_transfer.dist_port"
        if self.router.http_port is not None:
            if self.router.http_port in used:
                raise ValueError(f"router.http_port {self.router.http_port} is also {used[self.router.http_port]}")
            used[self.router.http_port] = "router.http_port"
        for name in ("prefill", "decode", "colocated"):
            pool: PoolConfig | None = getattr(self, name)
            if pool is None:
                continue
            bases = [("base_port", pool.base_port)]
            if pool.kv_base_port is not None:
                bases.append(("kv_base_port", pool.kv_base_port))
            if pool.metrics_base_port is not None:
                bases.append(("metrics_base_port", pool.metrics_base_port))
            if pool.engine.world_size > 1:
                bases.append(("shard_base_port", pool.shard_base_port))
            suffix = {"base_port": "", "kv_base_port": " KV", "metrics_base_port": " metrics",
                      "shard_base_port": " shard group"}
            for field_name, base in bases:
                for i in range(pool.worker_limit):
                    port = base + i
                    what = f"{name} worker {i}{suffix[field_name]}"
                    if port > 65535:
                        raise ValueError(f"{name}.{field_name} + {'max_workers' if pool.max_workers else 'num_workers'} "
                                         "runs past port 65535")
                    if port in used:
                        raise ValueError(f"port {port} of {what} is also {used[port]}")
                    used[port] = what

    def engine_config(self, pool: PoolConfig) -> EngineConfig:
        """The full engine config a worker of `pool` runs with."""
        return EngineConfig(model=self.model, **pool.engine.model_dump())


class ConfigError(ValueError):
    """A cluster YAML that cannot be used; the message names the file and the offending keys."""


def load_cluster_config(path: str | Path) -> ClusterConfig:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys")
    try:
        return ClusterConfig.model_validate(raw)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = ".".join(str(part) for part in err["loc"]) or "(top level)"
            lines.append(f"  {where}: {err['msg'].removeprefix('Value error, ')}")
        raise ConfigError(f"{path}: invalid cluster config\n" + "\n".join(lines)) from None
