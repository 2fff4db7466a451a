"""Ray actors hosting pdserve's processes: one per worker, one for the router.

Thin shells: a WorkerActor owns a WorkerHost (engine + role + sockets on a thread), the
RouterActor runs the asyncio gRPC router on a thread of its own. Both report readiness and
stats for `pdserve up` / `pdserve status` and tests.
"""

from __future__ import annotations

import asyncio
import os
import threading

import ray

from configs import EngineConfig, LoggingConfig, setup_logging


@ray.remote
class WorkerActor:
    def __init__(self, role: str, worker_id: str, engine_config: dict, host: str, command_port: int,
                 event_address: str, kv: dict, metrics: dict | None = None, logging_config: dict | None = None) -> None:
        """`metrics`: {"port", "peak_memory_bandwidth_gbps", "peak_tflops"} or None (no /metrics)."""
        from cluster.worker_host import WorkerHost
        from engine.peak import resolve_peak

        setup_logging(LoggingConfig(**(logging_config or {})), component=role, worker_id=worker_id)
        if host == "node":  # off loopback: bind this node's address (cluster/worker_launch.py)
            host = ray.util.get_node_ip_address()
        engine = EngineConfig(**engine_config)
        served = {}
        if metrics is not None:
            served = {"metrics_port": metrics["port"], "peak": resolve_peak(
                metrics["peak_memory_bandwidth_gbps"], metrics["peak_tflops"], engine.device, engine.dtype)}
        self.host = WorkerHost(role, worker_id, engine, host, command_port, event_address, **kv, **served)
        self.host.start()

    def ready(self) -> str:
        """The command address the router sends to (host:port this worker bound)."""
        return self.host.command_address

    def page_stats(self) -> dict[str, int]:
        return self.host.page_stats()

    def alive(self) -> bool:
        """False once the worker's serving loop has ended (the supervisor replaces it)."""
        return self.host.alive()

    def state(self) -> dict:
        """For `pdserve status`: where the worker runs, its queues and KV pages."""
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(), "alive": self.host.alive(),
                **self.host.state()}

    def stop(self) -> None:
        self.host.stop()


@ray.remote
class RouterActor:
    def __init__(self, model: str, cache_dir: str | None, router_kwargs: dict, host: str, port: int,
                 http_port: int | None = None, logging_config: dict | None = None) -> None:
        from engine.loader import resolve_model_path
        from router.server import Router
        from router.worker_pool import WorkerEndpoint

        setup_logging(LoggingConfig(**(logging_config or {})), component="router")
        model_dir = resolve_model_path(model, cache_dir)
        router_kwargs = dict(router_kwargs)
        router_kwargs["endpoints"] = [WorkerEndpoint(**e) for e in router_kwargs["endpoints"]]
        self.router = Router(model_dir, **router_kwargs)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="pdserve-router", daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self.router.start(host, port), self.loop).result(30)
        self.http = None
        if http_port is not None:  # the OpenAI-compatible front door, on the same event loop
            from router.openai_http import OpenAIServer

            self.http = OpenAIServer(self.router, model_dir, model)
            asyncio.run_coroutine_threadsafe(self.http.start(host, http_port), self.loop).result(30)

    def ready(self) -> bool:
        """True once every role the mode needs has a live worker."""
        return self.router.is_ready()

    def view(self) -> dict:
        return self._on_loop(self._async(self.router.view))

    def add_worker(self, endpoint: dict) -> None:
        from router.worker_pool import WorkerEndpoint

        self._on_loop(self._async(self.router.add_worker, WorkerEndpoint(**endpoint)))

    def drain_worker(self, worker_id: str, timeout_s: float) -> int:
        return self._on_loop(self.router.drain_worker(worker_id, timeout_s), timeout_s + 10)

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
