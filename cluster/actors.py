"""Ray actors hosting pdserve's processes: one per worker, one for the router.

Thin shells: a WorkerActor owns a WorkerHost (engine + role + sockets on a thread), the
RouterActor runs the asyncio gRPC router on a thread of its own. Both report readiness and
stats for `pdserve up` / `pdserve status` and tests.
"""

from __future__ import annotations

import asyncio
import os
import threading
from dataclasses import replace

import ray

from cluster.cpu_priority import compute_threads, lower_priority
from cluster.gc_policy import tune_for_serving
from cluster.specs import NODE_IP, WorkerSpec
from configs import LoggingConfig, setup_logging
from proto.flight.signals import install_sigusr1
from router.spec import RouterSpec
from router.worker_pool import WorkerEndpoint


@ray.remote
class WorkerActor:
    def __init__(self, spec: WorkerSpec, logging_config: LoggingConfig) -> None:
        from cluster.worker_host import WorkerHost

        setup_logging(logging_config, component=spec.role, worker_id=spec.worker_id)
        tune_for_serving()
        compute_threads(spec.num_threads)
        lower_priority(spec.nice)  # before the host's threads start: they inherit it
        if spec.host == NODE_IP:  # off loopback: bind this node's address (cluster/worker_launch.py)
            spec = replace(spec, host=ray.util.get_node_ip_address())
        self.host = WorkerHost(spec)
        self.host.start()
        if spec.flight.enabled:
            install_sigusr1(spec.flight.dump_dir)  # `kill -USR1 <pid>` dumps its flight recorder

    def ready(self) -> WorkerSpec:
        """This worker's spec with the host it bound: the command address the router sends to,
        and, for a decode worker, the KV address prefill workers may push to."""
        return self.host.spec

    def set_kv_destinations(self, addresses: tuple[str, ...]) -> None:
        """Prefill: the KV addresses of the cluster's decode workers (cluster/kv_destinations.py)."""
        self.host.set_kv_destinations(addresses)

    def page_stats(self) -> dict[str, int]:
        return self.host.page_stats()

    def alive(self) -> bool:
        """False once the worker's serving loop has ended (the supervisor replaces it)."""
        return self.host.alive()

    def state(self) -> dict:
        """For `pdserve status`: where the worker runs, its queues and KV pages."""
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(), "alive": self.host.alive(),
                **self.host.state()}

    def flight_dump(self) -> tuple[str, str]:
        """(this worker's id, its flight recorder dump as text) for `pdserve debug dump`."""
        return self.host.worker_id, self.host.flight_dump("pdserve debug dump")

    def stop(self) -> None:
        self.host.stop()

    def held_request_ids(self) -> list[str]:
        """Every request id this worker still holds anything for (WorkerHost.held_request_ids),
        sorted; empty once every request has ended (benchmarks/soak.py checks it on a live cluster)."""
        return sorted(self.host.held_request_ids())


@ray.remote
class RouterActor:
    def __init__(self, spec: RouterSpec, logging_config: LoggingConfig) -> None:
        from router.server import Router

        setup_logging(logging_config, component="router")
        tune_for_serving()
        lower_priority(spec.router.nice)  # before its threads start: they inherit it
        self.router = Router(spec)
        if spec.flight.enabled:
            install_sigusr1(spec.flight.dump_dir)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="pdserve-router", daemon=True)
        self.thread.start()
        cfg = spec.router
        self.port = asyncio.run_coroutine_threadsafe(self.router.start(cfg.host, cfg.grpc_port), self.loop).result(30)
        self.http = None
        if cfg.http_port is not None:  # the OpenAI-compatible front door, on the same event loop
            from router.openai_http import OpenAIServer

            self.http = OpenAIServer(self.router, spec.model_dir, spec.model_name)
            asyncio.run_coroutine_threadsafe(self.http.start(cfg.host, cfg.http_port), self.loop).result(30)

    def ready(self) -> bool:
        """True once every role the mode runs has a live worker."""
        return self.router.is_up()

    def view(self) -> dict:
        return self._on_loop(self._async(self.router.view))

    def add_worker(self, endpoint: WorkerEndpoint) -> None:
        self._on_loop(self._async(self.router.add_worker, endpoint))

    def worker_healthy(self, worker_id: str) -> bool:
        """Whether the router has a fresh heartbeat from `worker_id` (it routes to it now)."""
        return self._on_loop(self._async(self.router.worker_healthy, worker_id))

    def set_role(self, worker_id: str, role: str, reason: str) -> dict:
        """Flips a switchable worker (router/role_switch/flips.py); {"error": why} when it cannot."""
        try:
            return self._on_loop(self.router.set_role(worker_id, role, reason))
        except ValueError as exc:  # RoleFlipError: said as is, not as a remote traceback
            return {"error": str(exc)}

    def drain_worker(self, worker_id: str, timeout_s: float) -> int:
        return self._on_loop(self.router.drain_worker(worker_id, timeout_s), timeout_s + 10)

    def flight_dump(self) -> tuple[str, str]:
        """("router", the router's flight recorder dump as text) for `pdserve debug dump`."""
        return "router", self.router.flight_dump("pdserve debug dump")

    @staticmethod
    async def _async(fn, *args):
        return fn(*args)

    def _on_loop(self, coro, timeout_s: float = 30.0):
        """Runs `coro` on the router's event loop (its sockets and tables live there)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        if self.http is not None:
            asyncio.run_coroutine_threadsafe(self.http.stop(), self.loop).result(10)
        asyncio.run_coroutine_threadsafe(self.router.stop(0.5), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)

    def held(self) -> dict:
        """What the router holds for requests now (Router.held, read on its event loop), the ids
        sorted: empty and 0 once every request has ended (benchmarks/soak.py checks it)."""
        held = self._on_loop(self._async(self.router.held))
        return {**held, "request_ids": sorted(held["request_ids"])}
