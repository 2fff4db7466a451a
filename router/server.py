"""The router process's gRPC front door: the Generation service, grpc.health.v1 and reflection
(optional), behind the optional API key and TLS (router/security.py).

`Router.start` binds the gRPC port and the worker event port and returns; requests then run
concurrently as asyncio tasks, each through validation (router/validation.py), admission
control (a bound on requests in flight: RESOURCE_EXHAUSTED beyond it) and its journey
(router/journey.py). Health is SERVING while every role the mode needs has a live worker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from configs.logging_setup import EventLog
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc
from proto.flight.dump import render as render_dump
from proto.flight.dump import write as write_dump
from proto.flight.overrun import DeadlineWatch
from proto.flight.recorder import FlightRecorder
from router.in_flight import InFlight
from router.journey import run_journey
from router.journey_state import JourneySettings, RouterError
from router.metrics import RouterMetrics
from router.placement.decide import Placement, PlacementSettings
from router.placement.placer import Placer
from router.policy import make_policy
from router.prefill_gate import PrefillGate
from router.request_ids import LiveIds, new_client_id, new_internal_id
from router.role_switch.controller import RoleController
from router.role_switch.flips import RoleSwitcher
from router.security import ApiKeyInterceptor
from router.slo import SloTargets, tpot_of
from router.slo_admission import SloAdmission, SloRefused, colocated_ttft_s
from router.spec import RouterSpec
from router.tokenizer import RouterTokenizer
from router.validation import RequestLimits, check_request_id, deserialize_request, validate
from router.worker_pool import WorkerEndpoint, WorkerPool

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
# A request is at most a 1 MiB prompt (router.max_prompt_bytes) or ~1M token ids plus its
# settings; gRPC refuses anything larger (RESOURCE_EXHAUSTED) before a byte of it is parsed.
MAX_REQUEST_BYTES = 4 * 1024 * 1024
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = [("grpc.max_send_message_length", MAX_RESPONSE_BYTES),
                ("grpc.max_receive_message_length", MAX_REQUEST_BYTES)]


class Router:
    def __init__(self, spec: RouterSpec) -> None:
        self.spec = spec
        cfg = spec.router
        self.tokenizer = RouterTokenizer(spec.model_dir)
        model_config = json.loads((Path(spec.model_dir) / "config.json").read_text())
        context = int(model_config.get("max_position_embeddings", 2048))
        # What every engine behind this router accepts: engines reject longer at start-up, so the
        # router's limit is the engines' when set; a prompt over it is INVALID_ARGUMENT here.
        self.max_model_len = min(spec.max_model_len or context, context)
        self.endpoints = list(spec.endpoints)
        self.event_address = spec.event_address
        self.policy = make_policy(cfg.policy)
        self.slo_admission = (None if cfg.slo_admission_factor is None or cfg.slo_ttft_ms is None
                              else SloAdmission(cfg.slo_ttft_ms / 1000, cfg.slo_admission_factor))
        self.settings = JourneySettings(mode=spec.mode, kv_timeout_s=spec.kv_timeout_s, lease_s=spec.lease_s,
                                        max_attempts=cfg.max_attempts, retry_wait_s=cfg.retry_wait_s,
                                        max_prefill_queue_tokens=cfg.max_prefill_queue_tokens)
        self.prefill_gate = PrefillGate(cfg.max_prefill_queue_tokens)
        placement = cfg.placement
        self.placer = Placer(PlacementSettings(cfg.disaggregation, placement.stall_weight, placement.margin,
                                               None if cfg.slo_tpot_ms is None else cfg.slo_tpot_ms / 1000,
                                               placement.max_local_step_share, placement.cache_aware),
                             self.prefill_gate, self._placed)
        self.roles = ["colocated"] if spec.mode == "colocated" else ["prefill", "decode"]
        # What can serve a request: a decode worker can compute a prompt itself when no prefill
        # worker can (router/placement/), so a disaggregated router serves while one is healthy.
        self.serving_roles = ["colocated"] if spec.mode == "colocated" else ["decode"]
        self.default_timeout_s = spec.default_timeout_s
        self.heartbeat_timeout_s = cfg.heartbeat_timeout_s
        self.limits = RequestLimits.of(cfg)
        self.live_ids = LiveIds()  # client ids in flight -> internal ids: a second live one is ALREADY_EXISTS
        self.metrics = RouterMetrics(SloTargets.from_ms(cfg.slo_ttft_ms, cfg.slo_tpot_ms), cfg.slo_window_s)
        self.in_flight = InFlight(cfg.max_queued_requests, cfg.max_queued_prompt_tokens, self.metrics.in_flight)
        self.log = EventLog("router")
        flight = spec.flight
        # Every command sent, request event taken and state change, per request (proto/flight/):
        # dumped on SIGUSR1, `pdserve debug dump`, and when a request outlives its deadline.
        self.recorder = FlightRecorder("router", None, flight.capacity, header={
            "model_dir": spec.model_dir, "mode": spec.mode}) if flight.enabled else None
        if self.recorder is not None:
            self.log.tap = self.recorder.state
        self.overdue = DeadlineWatch(flight.overrun_grace_s) if flight.enabled and flight.dump_on_overrun else None
        self.pool: WorkerPool | None = None
        switching = cfg.role_switching
        controller = RoleController(switching, cfg.slo_ttft_ms / 1000, cfg.slo_tpot_ms / 1000) \
            if switching.mode == "auto" and cfg.slo_ttft_ms and cfg.slo_tpot_ms else None
        self.role_switcher = RoleSwitcher(switching, lambda: self.pool, self.log,
                                         lambda role, by: self.metrics.role_flips.labels(role, by).inc(), controller)
        self._switch_task: asyncio.Task | None = None
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self._health_task: asyncio.Task | None = None

    async def start(self, host: str, port: int) -> int:
        """Binds and starts serving; returns the bound gRPC port (port 0 picks one, for tests)."""
        rejected = self.metrics.rejected_messages
        self.pool = WorkerPool(self.endpoints, self.event_address, self.spec.cluster_secret, self.heartbeat_timeout_s,
                               on_reject=lambda reason: rejected.labels("worker_events", reason).inc(),
                               page_size=self.spec.page_size, recorder=self.recorder)
        self.pool.start()
        self.metrics.watch_kv_links(self.pool.link_states)
        security = self.spec.security
        # The key is checked before a request is read (health checks stay open, router/security.py).
        interceptors = [ApiKeyInterceptor(security.api_key, self.refused)] if security.api_key else []
        self.server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=interceptors)
        service = _GenerationService(self)
        # Registered by hand (not add_GenerationServicer_to_server) for the lenient request
        # deserializer: a request protobuf cannot parse still gets INVALID_ARGUMENT, not INTERNAL.
        handlers = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                service.Generate, request_deserializer=deserialize_request,
                response_serializer=pb.GenerateResponse.SerializeToString),
            "GenerateUnary": grpc.unary_unary_rpc_method_handler(
                service.GenerateUnary, request_deserializer=deserialize_request,
                response_serializer=pb.GenerateResponse.SerializeToString),
        }
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if self.spec.router.grpc_reflection:
            reflection.enable_server_reflection(
                (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
                self.server)
        credentials = security.grpc_credentials()
        bound = self.server.add_secure_port(f"{host}:{port}", credentials) if credentials else \
            self.server.add_insecure_port(f"{host}:{port}")
        await self.server.start()
        self._health_task = asyncio.get_running_loop().create_task(self._watch_health())
        if self.role_switcher.controller is not None:
            self._switch_task = asyncio.get_running_loop().create_task(self.role_switcher.run())
        return bound

    async def stop(self, grace_s: float = 1.0) -> None:
        for task in (self._health_task, self._switch_task):
            if task is not None:
                task.cancel()
        if self.server is not None:
            await self.server.stop(grace_s)
        if self.pool is not None:
            await self.pool.close()

    def held(self) -> dict:
        """What the router holds for requests now, on its event loop: the ids with an event
        subscription, a worker involved or a live client id, and the counts every request adds
        to and takes back (in flight, prompt tokens, prefill credit, the local queue, the gate's
        waiters). All empty or 0 once every request has ended: what a leak check asserts."""
        ids = self.live_ids.internal_ids() | (self.pool.request_ids() if self.pool is not None else set())
        return {"request_ids": ids, "in_flight": self.in_flight.requests,
                "in_flight_prompt_tokens": self.in_flight.prompt_tokens,
                "unprefilled_tokens": self.in_flight.unprefilled_tokens,
                "prefill_credit_tokens": self.prefill_gate.outstanding_tokens,
                "prefill_waiting": self.prefill_gate.num_waiting, "local_queue_tokens": self.placer.local.total()}

    def worker_healthy(self, worker_id: str) -> bool:
        """Whether `worker_id` is in the pool with a fresh heartbeat (requests may go to it)."""
        return self.pool is not None and self.pool.healthy(worker_id)

    def is_ready(self) -> bool:
        """Whether requests can be served now (gRPC health, HTTP /health)."""
        return self.pool is not None and self.pool.all_healthy(self.serving_roles)

    def is_up(self) -> bool:
        """Whether every role the mode runs has a live worker (what start-up waits for)."""
        return self.pool is not None and self.pool.all_healthy(self.roles)

    def _placed(self, request_id: str, client_id: str, placement: Placement) -> None:
        self.metrics.placements.labels(placement.kind, placement.reason).inc()
        self.log.event("placed", request_id, client_request_id=client_id or None, placement=placement.kind,
                       reason=placement.reason, prefill=placement.prefill, decode=placement.decode,
                       predicted_ttft_s=None if placement.predicted_ttft_s is None else round(placement.predicted_ttft_s, 6))

    # -- membership (pdserve scale / replacement; called on the router's event loop) -------------
    def add_worker(self, endpoint: WorkerEndpoint) -> None:
        """Routes to a new worker once its heartbeats say it is healthy. A replacement at a new
        address (another node) takes the old endpoint's place; at the same address, nothing to do."""
        known = self.pool.endpoints.get(endpoint.worker_id)
        if known == endpoint:
            return
        if known is not None:
            self.pool.remove(endpoint.worker_id)
        self.pool.add(endpoint)
        self.log.event("worker_added", None, worker=endpoint.worker_id, role=endpoint.role,
                       address=endpoint.command_address)

    async def drain_worker(self, worker_id: str, timeout_s: float) -> int:
        """Stops routing to `worker_id`, waits until the requests it holds have finished (or
        `timeout_s`), then forgets it; returns how many were still in flight (0 = drained)."""
        self.pool.drain(worker_id)
        self.log.event("worker_draining", None, worker=worker_id, in_flight=self.pool.in_flight(worker_id))
        deadline = time.monotonic() + timeout_s
        while self.pool.in_flight(worker_id) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = self.pool.in_flight(worker_id)
        self.pool.remove(worker_id)
        self.log.event("worker_removed", None, worker=worker_id, in_flight=left)
        return left

    async def set_role(self, worker_id: str, role: str, reason: str = "asked") -> dict:
        """Flips a switchable worker to `role` now (`pdserve role`); RoleFlipError says why it cannot."""
        return await self.role_switcher.flip(worker_id, role, reason)

    def view(self) -> dict:
        return {"ready": self.is_ready(), "in_flight": self.in_flight.requests, "workers": self.pool.view(),
                "recent_p90": self.metrics.slo_window.latency(0.9)}

    async def _watch_health(self) -> None:
        turn = 0
        while True:
            status = health_pb2.HealthCheckResponse.SERVING if self.is_ready() else \
                health_pb2.HealthCheckResponse.NOT_SERVING
            for name in ("", SERVICE_NAME):
                await self.health.set(name, status)
            turn += 1
            if turn % 5 == 0 and self.overdue is not None:  # about once a second
                for request_id, late_s in self.overdue.overdue():
                    await self._dump_overrun(request_id, late_s)
            await asyncio.sleep(0.2)

    async def _dump_overrun(self, request_id: str, late_s: float) -> None:
        """A request still held `late_s` past its deadline: a hang. The ring goes to a file (off
        the event loop) and the log says where."""
        assert self.recorder is not None
        try:
            path = await asyncio.to_thread(write_dump, self.recorder, self.spec.flight.dump_dir,
                                           f"overrun {request_id}")
        except OSError as exc:
            self.log.event("overrun", request_id, level=logging.ERROR, late_s=round(late_s, 3), dump_error=str(exc))
            return
        self.log.event("overrun", request_id, level=logging.ERROR, late_s=round(late_s, 3), dump=str(path))

    def flight_dump(self, reason: str = "asked") -> str:
        """The router's flight recorder dump (proto/flight/dump.py) as text; "" when it has none."""
        return "" if self.recorder is None else render_dump(self.recorder, reason)

    async def generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        async for response in self.run(request, context.time_remaining()):
            yield response

    async def run(self, request: pb.GenerateRequest, time_remaining_s: float | None = None
                  ) -> AsyncIterator[pb.GenerateResponse]:
        """One request through admission, validation and its journey (both front doors). The
        router's internal id (router/request_ids.py) names it on every worker and in every log
        line on every process; the router's lines carry the client's id too (`client_request_id`),
        and the responses carry only the client's id (the one it gave, or a fresh one)."""
        rid = new_internal_id()
        # getattr: a request protobuf could not parse arrives as a placeholder without fields.
        client_id = getattr(request, "request_id", "") or new_client_id()
        try:
            check_request_id(client_id, self.limits)
        except RouterError:
            client_id = ""  # not logged as given (it may hold anything); validate() answers the client
        ids = {"client_request_id": client_id or None}
        self.log.event("received", rid, **ids)
        try:
            # Off the event loop: tokenizing a long prompt must not stall every other stream.
            journey = replace(await asyncio.to_thread(validate, request, self.tokenizer, self.max_model_len,
                                                      self.default_timeout_s, None, self.limits),
                              request_id=rid, client_id=client_id)
            # Checked after the await, with nothing between them and the admission below.
            self.in_flight.check(len(journey.prompt))
            if self.slo_admission is not None:
                self.slo_admission.check(self._predicted_ttft_s(journey.prompt))
            self.live_ids.admit(journey.client_id, rid)  # ALREADY_EXISTS while another is live under it
        except SloRefused as exc:
            self.metrics.slo_refused.inc()
            self._failed(rid, ids, exc.code, str(exc), admitted=False)
            raise
        except RouterError as exc:
            self._failed(rid, ids, exc.code, str(exc), admitted=False)
            raise
        if time_remaining_s is not None:  # the client's own deadline, if sooner
            journey = replace(journey, deadline=min(journey.deadline, time.monotonic() + time_remaining_s))
        start = last = time.monotonic()
        self.log.event("admitted", rid, **ids, prompt_tokens=len(journey.prompt), max_tokens=journey.sampling.max_tokens)

        def dispatched(worker_id: str) -> None:
            self.metrics.queue_time.observe(time.monotonic() - start)
            self.log.event("dispatched", rid, **ids, worker=worker_id)

        ttft = None
        num_tokens = 0
        finished = False
        admitted = self.in_flight.admit(len(journey.prompt))  # ended in the finally below, whatever happens
        if self.overdue is not None:
            self.overdue.start(rid, journey.deadline)
        try:
            async for response in run_journey(journey, self.pool, self.policy, self.tokenizer, self.settings,
                                              on_dispatch=dispatched, gate=self.prefill_gate, placer=self.placer):
                now = time.monotonic()
                if response.token_ids:
                    if ttft is None:
                        ttft = now - start
                        admitted.first_token()
                        self.log.event("first_token", rid, **ids, ttft_s=round(ttft, 6))
                    else:
                        self.metrics.itl.observe(now - last)
                    last = now
                num_tokens += len(response.token_ids)
                if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    reason = pb.FinishReason.Name(response.finish_reason).removeprefix("FINISH_REASON_").lower()
                    usage = response.usage
                    self.metrics.request_finished(reason, ttft, now - start, num_tokens, usage.prompt_tokens,
                                                  usage.cached_prompt_tokens, usage.spec_proposed_tokens,
                                                  usage.spec_accepted_tokens)
                    self.metrics.request_stages(usage)
                    self.role_switcher.observe(ttft, tpot_of(ttft, now - start, num_tokens))
                    self.log.event("finished", rid, **ids, finish_reason=reason, completion_tokens=num_tokens,
                                   cached_prompt_tokens=response.usage.cached_prompt_tokens,
                                   e2e_s=round(now - start, 6))
                    finished = True
                yield response
        except RouterError as exc:
            self._failed(rid, ids, exc.code, str(exc), admitted=True)
            raise
        except asyncio.CancelledError:
            self._failed(rid, ids, grpc.StatusCode.CANCELLED, "cancelled by the client", admitted=True)
            raise
        except GeneratorExit:
            # The consumer closed the stream: an HTTP handler whose write to a gone client raised
            # (rather than being cancelled) lands here. Before the finish that is a cancellation too.
            if not finished:
                self._failed(rid, ids, grpc.StatusCode.CANCELLED, "the client went away", admitted=True)
            raise
        finally:
            self.live_ids.end(journey.client_id, rid)
            admitted.end()
            if self.overdue is not None:
                self.overdue.end(rid)


    def _predicted_ttft_s(self, prompt: tuple[int, ...]) -> float | None:
        """What this prompt's TTFT would be if admitted now (router/slo_admission.py); None:
        nothing measured to predict with."""
        assert self.pool is not None
        if self.spec.mode == "colocated":
            rates = [w.prefill_tokens_per_s for w in self.pool.loads("colocated") if w.healthy]
            return colocated_ttft_s(self.in_flight.unprefilled_tokens, len(prompt), rates)
        placement = self.placer.place(self.pool, len(prompt), self.pool.blocks.prompt_hashes(prompt),
                                      self.prefill_gate.waiting_tokens)
        return None if placement is None else placement.predicted_ttft_s

    def refused(self, door: str, reason: str) -> None:
        """A call without the right API key, refused before any work (counted; never the key logged)."""
        self.metrics.request_failed(grpc.StatusCode.UNAUTHENTICATED.name, admitted=False)
        self.log.event("unauthenticated", None, level=logging.WARNING, door=door, reason=reason)

    def _failed(self, request_id: str, ids: dict, code: grpc.StatusCode, message: str, admitted: bool) -> None:
        self.metrics.request_failed(code.name, admitted)
        self.log.event("error", request_id, level=logging.WARNING, **ids, status=code.name, message=message)


async def _abort(context, exc: RouterError) -> None:
    """Ends the call with the error's status; a refusal that says when to come back also sets
    the `retry-after` trailer (seconds), as HTTP's Retry-After."""
    if isinstance(exc, SloRefused):
        context.set_trailing_metadata((("retry-after", str(exc.retry_after_s)),))
    await context.abort(exc.code, str(exc))


class _GenerationService(pdserve_pb2_grpc.GenerationServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    async def Generate(self, request, context):
        try:
            async for response in self.router.generate(request, context):
                yield response
        except RouterError as exc:
            await _abort(context, exc)

    async def GenerateUnary(self, request, context):
        text, ids, logprobs, last = [], [], [], None
        try:
            async for response in self.router.generate(request, context):
                text.append(response.text)
                ids += response.token_ids
                logprobs += response.logprobs
                last = response
        except RouterError as exc:
            await _abort(context, exc)
        return pb.GenerateResponse(request_id=last.request_id, text="".join(text), token_ids=ids, logprobs=logprobs,
                                   finish_reason=last.finish_reason, usage=last.usage)
