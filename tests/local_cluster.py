"""A whole cluster inside one process, without Ray: worker roles on threads, the router on an
asyncio thread, ZMQ on loopback between them. For tests that need the real
sockets and gRPC path but not Ray's process placement (`pdserve up` uses Ray actors). A test
fixture: nothing shipped imports it."""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.specs import kv_destinations, router_spec, worker_spec
from cluster.worker_host import WorkerHost
from cluster.worker_launch import endpoint_of
from configs import ClusterConfig, EngineConfig
from engine.metrics.peak import Peak
from loadgen.credentials import ClientAuth
from proto import pdserve_pb2_grpc
from proto.frame_auth import ClusterSecret
from router.server import Router
from tests.fault_injection import crash_tap

# Ports handed to tests come from below the kernel's ephemeral range (32768-60999 on Linux) and
# above Ray's worker ports (10002-19999): a port the kernel picked for us stays free only until
# its next ephemeral bind, and gloo, Ray and every outgoing connection bind ephemeral ports all
# the time (CI once lost decode-0's command port to one). Each call takes a fresh block of
# _BLOCK ports, because configs use base_port + worker index; the random start keeps two test
# processes on one machine apart. It starts above 26000: LocalCluster's configs name nominal
# base ports in 20000-25999 (base_port, kv_base_port, metrics_base_port + worker index) and the
# config rejects a router port equal to one of them (a free port of 25000 once failed a setup).
_FIRST_PORT, _LAST_PORT, _BLOCK = 26000, 32000, 8
_next_port = _FIRST_PORT + random.Random().randrange(0, _LAST_PORT - _FIRST_PORT, _BLOCK)
_port_lock = threading.Lock()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback port nobody listens on, with the _BLOCK - 1 ports after it free too."""
    global _next_port
    with _port_lock:
        for _ in range((_LAST_PORT - _FIRST_PORT) // _BLOCK):
            port = _next_port
            _next_port = port + _BLOCK if port + 2 * _BLOCK <= _LAST_PORT else _FIRST_PORT
            if all(_bindable(p) for p in range(port, port + _BLOCK)):
                return port
    raise RuntimeError(f"no {_BLOCK} free ports in a row between {_FIRST_PORT} and {_LAST_PORT}")


class LocalCluster:
    def __init__(self, model_dir, mode: str, engine: EngineConfig, num_workers: int | dict[str, int] = 1,
                 ready_timeout_s: float = 60.0, metrics_peak: Peak | None = None,
                 crash_when: dict[str, Callable[[object], str | None]] | None = None,
                 kv_timeout_s: float = 30.0, lease_s: float = 30.0, flight: dict | None = None,
                 **router: object) -> None:
        """`metrics_peak`: serve each worker's /metrics on a free port (`metrics_address`),
        measuring MBU / MFU against this peak; `num_workers` per role (or {role: n}); `crash_when`: worker id
        -> when to crash it (tests/fault_injection.py); `flight`: the flight_recorder block;
        `router`: RouterConfig fields (SLOs,
        retries, heartbeat timeout, queue bounds), validated as the YAML's would be.

        The cluster is described by a ClusterConfig and its processes' specs are built from it
        by cluster/specs.py, as `pdserve up` builds them; only the ports differ (free ones)."""
        roles = ["colocated"] if mode == "colocated" else ["prefill", "decode"]
        settings = engine.model_dump(exclude={"model"})
        counts = num_workers if isinstance(num_workers, dict) else dict.fromkeys(roles, num_workers)
        pools = {role: {"num_workers": counts[role], "base_port": 20000 + 1000 * k, "engine": settings,
                        **({"kv_base_port": 23000} if role == "decode" else {}),
                        # Switchable prefill workers receive KV once they flip to decode.
                        **({"kv_base_port": 25500} if role == "prefill" and "role_switching" in router else {}),
                        **({"metrics_base_port": 24000 + 1000 * k} if metrics_peak else {})}
                 for k, role in enumerate(roles)}
        self.config = ClusterConfig.model_validate({
            "model": engine.model, "mode": mode, **pools,
            "router": {"host": "127.0.0.1", "grpc_port": 1, "worker_event_port": free_port(), "control_port": 2,
                       **router},
            "kv_transfer": {"timeout_s": kv_timeout_s, "reservation_lease_s": lease_s, "checksum": True},
            "flight_recorder": flight or {},
        })
        self.secret = ClusterSecret.generate()  # as `pdserve up` makes one: every internal message is signed
        self.hosts = []
        for role in roles:
            for i in range(counts[role]):
                spec = worker_spec(self.config, role, i, "127.0.0.1", "127.0.0.1", self.secret)
                spec = replace(spec, command_port=free_port(), kv_port=free_port() if spec.kv_port else None,
                               metrics_port=free_port() if spec.metrics_port else None)
                when = (crash_when or {}).get(spec.worker_id)
                tap = crash_tap(spec.worker_id, when) if when is not None else None
                self.hosts.append(WorkerHost(spec, peak=metrics_peak, event_tap=tap))
        # As `pdserve up` does (cluster/kv_destinations.py): prefill workers push KV only to these.
        destinations = kv_destinations(h.spec for h in self.hosts)
        for h in self.hosts:
            if h.role == "prefill" or h.spec.switchable:
                h.set_kv_destinations(destinations)
        for h in self.hosts:
            h.start()
        endpoints = [endpoint_of(h.spec) for h in self.hosts]
        self.router = Router(router_spec(self.config, str(model_dir), endpoints, "127.0.0.1", self.secret))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self.router.start("127.0.0.1", 0), self.loop).result(30)
        # A TLS router (router.tls_cert_file) is dialled trusting its own, self-signed, certificate.
        r = self.config.router
        self.channel = ClientAuth(tls=r.wants_tls, tls_ca_file=r.tls_cert_file).grpc_channel(f"127.0.0.1:{self.port}")
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

    def held(self) -> dict:
        """What the router (Router.held, read on its loop) and every live worker
        (WorkerHost.held_request_ids) still hold for requests."""

        async def read() -> dict:
            return self.router.held()

        held = asyncio.run_coroutine_threadsafe(read(), self.loop).result(10)
        held["workers"] = {h.worker_id: h.held_request_ids() for h in self.hosts if not h.crashed}
        return held

    def close(self) -> None:
        self.channel.close()
        asyncio.run_coroutine_threadsafe(self.router.stop(0.2), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        for h in self.hosts:
            h.stop()
