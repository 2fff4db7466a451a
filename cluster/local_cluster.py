"""A whole cluster inside one process, without Ray: worker roles on threads, the router on an
asyncio thread, ZMQ on loopback between them. For tests and benchmarks that need the real
sockets and gRPC path but not Ray's process placement (`pdserve up` uses Ray actors)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.worker_host import WorkerHost
from configs import EngineConfig
from engine.peak import Peak
from proto import pdserve_pb2_grpc
from router.server import Router
from router.worker_pool import WorkerEndpoint


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalCluster:
    def __init__(self, model_dir, mode: str, engine: EngineConfig, max_queued_requests: int = 64,
                 ready_timeout_s: float = 60.0, metrics_peak: Peak | None = None, num_workers: int = 1,
                 crash_when: dict[str, Callable[[object], str | None]] | None = None, **router_options) -> None:
        """`metrics_peak`: serve each worker's /metrics on a free port (`metrics_address`),
        measuring MBU / MFU against this peak; `num_workers` per role; `crash_when`: worker id
        -> fault-injection hook (cluster/worker_host.py); `router_options`: more Router
        settings (SLOs, retries, heartbeat timeout)."""
        event = f"127.0.0.1:{free_port()}"
        roles = ["colocated"] if mode == "colocated" else ["prefill", "decode"]
        self.hosts = [WorkerHost(role, f"{role}-{i}", engine, "127.0.0.1", free_port(), event,
                                 kv_port=free_port() if role == "decode" else None, kv_checksum=True,
                                 metrics_port=free_port() if metrics_peak else None, peak=metrics_peak,
                                 crash_when=(crash_when or {}).get(f"{role}-{i}"))
                      for role in roles for i in range(num_workers)]
        for h in self.hosts:
            h.start()
        endpoints = [WorkerEndpoint(h.worker_id, h.role, h.command_address) for h in self.hosts]
        self.router = Router(model_dir, endpoints, event, mode, max_queued_requests=max_queued_requests,
                             **{"kv_timeout_s": 30, "lease_s": 30, **router_options})
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self.router.start("127.0.0.1", 0), self.loop).result(30)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pdserve_pb2_grpc.GenerationStub(self.channel)
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + ready_timeout_s
        while (health.Check(health_pb2.HealthCheckRequest()).status != health_pb2.HealthCheckResponse.SERVING
               or not all(self.router.pool.healthy(h.worker_id) for h in self.hosts)):
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError("the local cluster never became healthy")
            time.sleep(0.05)

    def metrics_address(self, worker_id: str) -> str:
        host = next(h for h in self.hosts if h.worker_id == worker_id)
        return f"127.0.0.1:{host.metrics_port}"

    def wait_pages_free(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            stats = [h.page_stats() for h in self.hosts if not h.crashed]  # a dead worker's pages died with it
            if all(s["referenced"] == 0 for s in stats):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"pages still referenced: {stats}")
            time.sleep(0.05)

    def close(self) -> None:
        self.channel.close()
        asyncio.run_coroutine_threadsafe(self.router.stop(0.2), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        for h in self.hosts:
            h.stop()
