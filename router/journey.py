"""One request's journey through the cluster, as seen by the router (DESIGN.md section 2).

`run_journey` drives the worker messages for one validated request and yields response
messages as text becomes available. Disaggregated: reserve pages on a decode worker first
(retrying while the pool is full: backpressure), then prefill, stream the first token as soon
as it arrives, start decode, stream the rest. Colocated: one Generate. Whatever ends the
journey (finish, stop string, error, cancel, deadline), the `finally` sends Abort to every
worker involved that may still hold something, so pages are freed on every side.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from proto import pdserve_pb2 as pb
from proto import worker_messages as wm
from router.policy import LeastLoadedPolicy
from router.stop_strings import StopStringMatcher
from router.tokenizer import IncrementalDetokenizer, RouterTokenizer
from router.worker_pool import WorkerPool

FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


class RouterError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Journey:
    request_id: str
    prompt: tuple[int, ...]
    sampling: wm.Sampling
    stop: tuple[str, ...]
    deadline: float  # time.monotonic() value


@dataclass(frozen=True)
class JourneySettings:
    mode: str  # "disaggregated" or "colocated"
    kv_timeout_s: float
    lease_s: float
    reserve_retry_s: float = 0.02


async def run_journey(
    j: Journey, pool: WorkerPool, policy: LeastLoadedPolicy, tokenizer: RouterTokenizer, settings: JourneySettings,
    on_dispatch: Callable[[str], None] | None = None,
) -> AsyncIterator[pb.GenerateResponse]:
    """`on_dispatch(worker_id)` is called once, when the prompt is sent to the worker that
    computes it (after any wait for decode pages): the end of the request's router queue time."""
    events = pool.subscribe(j.request_id)
    involved: set[str] = set()
    finished = False
    start = time.monotonic()
    ttft = None
    detok = IncrementalDetokenizer(tokenizer)
    stops = StopStringMatcher(list(j.stop))
    num_generated = 0
    num_cached = 0
    try:
        if settings.mode == "colocated":
            worker = policy.choose_decode(j.prompt, pool.loads("colocated"))
            if worker is None:
                raise RouterError(grpc.StatusCode.UNAVAILABLE, "no healthy colocated worker")
            involved.add(worker)
            await pool.send(worker, wm.Generate(j.request_id, j.prompt, j.sampling))
            if on_dispatch is not None:
                on_dispatch(worker)
        else:
            decode_worker = await _reserve(j, pool, policy, settings, events, involved)
        while True:
            msg = await _next(events, j.deadline, pool, involved)
            if isinstance(msg, wm.Reserved):
                prefill = policy.choose_prefill(j.prompt, pool.loads("prefill"))
                if prefill is None:
                    raise RouterError(grpc.StatusCode.UNAVAILABLE, "no healthy prefill worker")
                policy.record(j.prompt, prefill)
                involved.add(prefill)
                kv = wm.KVDestination(msg.kv_address, msg.num_pages, msg.num_cached_pages, settings.kv_timeout_s)
                await pool.send(prefill, wm.Prefill(j.request_id, j.prompt, j.sampling, kv))
                if on_dispatch is not None:
                    on_dispatch(prefill)
                continue
            if isinstance(msg, wm.Failed):
                raise RouterError(grpc.StatusCode.UNAVAILABLE, f"{msg.stage} failed on {msg.worker_id}: {msg.reason}")
            if isinstance(msg, wm.TransferEnded):
                continue  # a failed transfer also reaches us as the decode worker's Failed
            if isinstance(msg, wm.FirstToken):
                await pool.send(decode_worker, wm.StartDecode(j.request_id, j.prompt, msg.token_id, j.sampling))
                new_ids, reason, num_cached = [msg.token_id], None, msg.num_cached_prompt_tokens
            elif isinstance(msg, wm.Tokens):
                new_ids, reason = list(msg.token_ids), msg.finish_reason if msg.finished else None
                if settings.mode == "colocated":  # disaggregated: the prefill side's count (FirstToken)
                    num_cached = msg.num_cached_prompt_tokens
            else:
                continue
            ttft = ttft if ttft is not None or not new_ids else time.monotonic() - start
            num_generated += len(new_ids)
            text = stops.push(detok.push(new_ids))
            if stops.stopped:
                reason = "stop"
            if reason is not None:
                if not stops.stopped:  # the end of the stream: release what was held back
                    text += stops.push(detok.flush())
                    text += stops.flush()
                    reason = "stop" if stops.stopped else reason
                finished = reason != "abort"
                yield pb.GenerateResponse(
                    request_id=j.request_id, text=text, token_ids=new_ids, finish_reason=FINISH[reason],
                    usage=pb.Usage(prompt_tokens=len(j.prompt), completion_tokens=num_generated,
                                   cached_prompt_tokens=num_cached, ttft_s=ttft or 0.0))
                return
            if text or new_ids:
                yield pb.GenerateResponse(request_id=j.request_id, text=text, token_ids=new_ids)
    finally:
        pool.unsubscribe(j.request_id)
        if not finished or stops.stopped:
            for worker in involved:  # cancel, deadline, error or stop string: free every side
                try:
                    await pool.send(worker, wm.Abort(j.request_id))
                except Exception:  # noqa: BLE001 - best effort; the workers' leases are the backstop
                    pass


async def _reserve(j, pool, policy, settings, events, involved) -> str:
    """Reserves decode pages, retrying while every decode worker is full (backpressure)."""
    while True:
        worker = policy.choose_decode(j.prompt, pool.loads("decode"))
        if worker is None:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "no healthy decode worker")
        involved.add(worker)
        await pool.send(worker, wm.ReserveKV(j.request_id, j.prompt, settings.lease_s))
        msg = await _next(events, j.deadline, pool, involved)
        if isinstance(msg, wm.Reserved):
            events.put_nowait(msg)  # let the main loop act on it
            return worker
        if isinstance(msg, wm.Failed):
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT if msg.stage == "reserve" else grpc.StatusCode.UNAVAILABLE,
                              msg.reason)
        await asyncio.sleep(settings.reserve_retry_s)


async def _next(events: asyncio.Queue, deadline: float, pool: WorkerPool, involved: set[str],
                check_every_s: float = 0.25) -> object:
    """The next event for this request. Fails fast, instead of waiting out the deadline, when a
    worker holding part of the request stops sending heartbeats."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "request deadline expired")
        try:
            return await asyncio.wait_for(events.get(), min(remaining, check_every_s))
        except asyncio.TimeoutError:
            dead = sorted(w for w in involved if not pool.healthy(w))
            if dead:
                raise RouterError(grpc.StatusCode.UNAVAILABLE,
                                  f"worker {', '.join(dead)} stopped responding (no heartbeat)") from None
