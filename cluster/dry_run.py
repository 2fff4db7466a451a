"""`pdserve up CONFIG --dry-run`: every process a config would start, built and printed, nothing started.

Sits beside cluster/launcher.py `up` and builds exactly what it builds: each worker's
WorkerSpec (cluster/specs.py: ports, engine, KV transport, its rank and sources in a torch_dist
group), the Ray bundles each worker's shards ask for (cluster/placement.py) and the router's
ports. No Ray, no model, no GPU: a GPU config (configs/gpu.yaml) is checked on a laptop, and a
config that cannot run fails here with the same error `up` would give.
"""

from __future__ import annotations

from cluster.placement import shard_bundles
from cluster.specs import NODE_IP, serving_pools, worker_spec
from cluster.worker_launch import on_loopback
from configs import ClusterConfig
from configs.cluster import RouterConfig


def internal_host(config: ClusterConfig) -> str:
    """cluster/worker_launch.py `worker_host`, with NODE_IP standing for "this node's address"
    where that needs a running Ray to know."""
    if config.router.internal_host is not None:
        return config.router.internal_host
    if config.router.host != "0.0.0.0":
        return config.router.host
    return "127.0.0.1" if on_loopback(config) else NODE_IP


def _guard(r: RouterConfig) -> str:
    """The public doors' protection, named by its sources (never the key itself)."""
    parts = []
    if r.wants_tls:
        parts.append(f"TLS {r.tls_cert_file}")
    if r.wants_api_key:
        source = (f"env {r.api_key_env}" if r.api_key_env else f"file {r.api_key_file}" if r.api_key_file
                  else "the YAML")
        parts.append(f"API key from {source}")
    return "; " + ", ".join(parts) if parts else ""


def plan(config: ClusterConfig) -> list[str]:
    """One line per process group `up` would start (router first), each spec built and checked."""
    router_host = internal_host(config)
    r = config.router
    lines = [f"router: gRPC {r.host}:{r.grpc_port}"
             + (f", HTTP {r.host}:{r.http_port}" if r.http_port else "")
             + f"; worker events {router_host}:{r.worker_event_port}, control {router_host}:{r.control_port}"
             + f"; model {config.model}, mode {config.mode}" + _guard(r)]
    for role, pool in serving_pools(config):
        for index in range(pool.num_workers):
            spec = worker_spec(config, role, index, router_host if on_loopback(config) else NODE_IP, router_host)
            engine = spec.engine
            kv = ""
            if role == "decode" and spec.kv_transport == "zmq":
                kv = f", KV in on {spec.host}:{spec.kv_port}"
            elif spec.kv_transport == "torch_dist" and role != "colocated":
                kv = f", KV group rank {spec.dist_rank} of {spec.dist_world_size} at {spec.dist_store_address}"
                if spec.dist_sources:
                    kv += f" (from ranks {', '.join(map(str, spec.dist_sources))})"
            bundles = shard_bundles(pool)
            lines.append(
                f"{spec.worker_id}: commands {spec.host}:{spec.command_port}{kv}; {engine.device} {engine.dtype}, "
                f"TP {engine.tensor_parallel_size} x PP {engine.pipeline_parallel_size}, "
                f"{len(bundles)} x {bundles[0]}"
                + (f", metrics :{spec.metrics_port}" if spec.metrics_port is not None else ""))
        if pool.max_workers is not None and pool.max_workers > pool.num_workers:
            lines.append(f"{role}: up to {pool.max_workers} workers (ports reserved for {pool.num_workers}.."
                         f"{pool.max_workers - 1})")
    return lines
