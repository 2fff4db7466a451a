"""Ray actors hosting pdserve's processes: one per worker, one for the router.

Thin shells: a WorkerActor owns a WorkerHost (engine + role + sockets on a thread), the
RouterActor runs the asyncio gRPC router on a thread of its own. Both report readiness and
stats for `pdserve up` / `pdserve status` and tests.
"""

from __future__ import annotations

import asyncio
import threading

import ray

from configs import EngineConfig


@ray.remote
class WorkerActor:
    def __init__(self, role: str, worker_id: str, engine_config: dict, host: str, command_port: int,
                 event_address: str, kv: dict) -> None:
        from cluster.worker_host import WorkerHost

        self.host = WorkerHost(role, worker_id, EngineConfig(**engine_config), host, command_port, event_address, **kv)
        self.host.start()

    def ready(self) -> str:
        return self.host.worker_id

    def page_stats(self) -> dict[str, int]:
        return self.host.page_stats()

    def stop(self) -> None:
        self.host.stop()


@ray.remote
class RouterActor:
    def __init__(self, model: str, cache_dir: str | None, router_kwargs: dict, host: str, port: int,
                 http_port: int | None = None) -> None:
        from engine.loader import resolve_model_path
        from router.server import Router
        from router.worker_pool import WorkerEndpoint

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

    def stop(self) -> None:
        if self.http is not None:
            asyncio.run_coroutine_threadsafe(self.http.stop(), self.loop).result(10)
        asyncio.run_coroutine_threadsafe(self.router.stop(0.5), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
