"""One request's journey through the cluster, as seen by the router (docs/design.md §2).

`run_journey` drives the worker messages for one validated request and yields response
messages as text becomes available. Disaggregated: wait for a prefill worker with room
(router/prefill_gate.py: the queue waits here, holding nothing), reserve pages on a decode
worker (retrying while the pool is full: backpressure), then prefill, stream the first token as soon
as it arrives, start decode, stream the rest. Colocated: one Generate. Whatever ends an
attempt (finish, stop string, error, cancel, deadline, a lost worker), its `finally` sends
Abort to every worker involved that may still hold something, so pages are freed on every side.

A worker that dies under a request (no heartbeat, or a KV transfer that failed because its
sender died) does not fail the request: a new attempt re-sends the prompt plus every token the
client already has, as a fresh prompt, to healthy workers (another decode reservation, another
prefill), and the stream goes on where it stopped. Greedy decoding continues with exactly the
tokens the lost worker would have produced; sampled decoding continues from the same text with
fresh draws. Attempt k > 0 runs on the workers under the id `<request id>.retry<k>`, so events
of a lost attempt are never mistaken for the new one's. After `max_attempts` the client gets
UNAVAILABLE naming what was lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

import grpc

from proto import pdserve_pb2 as pb
from proto import worker_messages as wm
from router.policy import LeastLoadedPolicy
from router.prefill_gate import PrefillGate
from router.stop_strings import StopStringMatcher
from router.tokenizer import IncrementalDetokenizer, RouterTokenizer
from router.worker_pool import WorkerPool

log = logging.getLogger(__name__)
FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


class RouterError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class WorkerLost(RouterError):
    """A worker holding part of an attempt died (or its KV transfer did): worth another attempt."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


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
    max_prefill_queue_tokens: int = 8192  # prompt tokens sent to one prefill worker, not yet prefilled
    max_attempts: int = 3  # the first try plus retries after lost workers
    retry_wait_s: float = 10.0  # a retry waits this long for a healthy worker (a replacement) to appear


@dataclass
class _Stream:
    """What the client has been sent so far; survives attempts."""

    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    start: float = field(default_factory=time.monotonic)
    ttft: float | None = None
    generated: list[int] = field(default_factory=list)
    num_cached: int = 0
    ended: bool = False  # the client got a finish reason
    done: bool = False  # ... and it was not "abort": the workers freed what they held themselves


async def run_journey(
    j: Journey, pool: WorkerPool, policy: LeastLoadedPolicy, tokenizer: RouterTokenizer, settings: JourneySettings,
    on_dispatch: Callable[[str], None] | None = None, gate: PrefillGate | None = None,
) -> AsyncIterator[pb.GenerateResponse]:
    """`on_dispatch(worker_id)` is called once, when the prompt is first sent to the worker that
    computes it (after any wait for prefill room and decode pages): the end of the request's
    router queue time. `gate` is shared by every request of one router (disaggregated mode)."""
    gate = gate or PrefillGate(settings.max_prefill_queue_tokens)
    stream = _Stream(IncrementalDetokenizer(tokenizer), StopStringMatcher(list(j.stop)))
    dispatched = [] if on_dispatch is None else [on_dispatch]
    lost: list[str] = []
    for attempt in range(settings.max_attempts):
        if attempt > 0 and (reason := _ended(j, stream, tokenizer)) is not None:
            yield _respond(j, stream, [], reason)  # the lost worker had nothing left to send
            return
        try:
            async with contextlib.aclosing(_attempt(j, attempt, stream, pool, policy, settings, dispatched, gate)
                                           ) as tries:
                async for response in tries:
                    yield response
            return
        except WorkerLost as exc:
            lost.append(str(exc))
            log.warning("request %s: attempt %d lost (%s); %s", j.request_id, attempt + 1, exc,
                        "retrying" if attempt + 1 < settings.max_attempts else "giving up")
        except RouterError as exc:
            if not lost:
                raise
            raise RouterError(exc.code, f"{exc} (retrying after: {'; '.join(lost)})") from None
    raise RouterError(grpc.StatusCode.UNAVAILABLE, f"gave up after {settings.max_attempts} attempts: {'; '.join(lost)}")


def _ended(j: Journey, stream: _Stream, tokenizer: RouterTokenizer) -> str | None:
    """The finish reason the lost worker would have sent, when the client already has the
    request's last token: max_tokens reached, or a stop / end-of-sequence token."""
    if len(stream.generated) >= j.sampling.max_tokens:
        return "length"
    last = stream.generated[-1] if stream.generated else None
    if last is not None and (last in j.sampling.stop_token_ids
                             or (not j.sampling.ignore_eos and last in tokenizer.eos_token_ids)):
        return "stop"
    return None


async def _attempt(j: Journey, attempt: int, stream: _Stream, pool: WorkerPool, policy: LeastLoadedPolicy,
                   settings: JourneySettings, dispatched: list, gate: PrefillGate) -> AsyncIterator[pb.GenerateResponse]:
    """One try at the rest of the request: the prompt plus what the client already has."""
    rid = j.request_id if attempt == 0 else f"{j.request_id}.retry{attempt}"
    prompt = j.prompt + tuple(stream.generated)
    sampling = replace(j.sampling, max_tokens=j.sampling.max_tokens - len(stream.generated))
    events = pool.subscribe(rid)
    involved: set[str] = set()  # workers that may hold something of this attempt: Abort them at the end
    watched: dict[str, str | None] = {}  # workers whose death (or replacement) ends this attempt -> incarnation
    wait_s = settings.retry_wait_s if attempt > 0 else 0.0

    def use(worker: str) -> None:
        involved.add(worker)
        watched[worker] = pool.incarnation(worker)
        pool.involve(rid, worker)

    def done_with(worker: str) -> None:
        """`worker` holds nothing more of this attempt."""
        involved.discard(worker)
        watched.pop(worker, None)
        pool.uninvolve(rid, worker)

    def first_dispatch(worker: str) -> None:
        while dispatched:
            dispatched.pop()(worker)

    gated: list[str] = []  # the prefill worker whose gate credit this attempt holds (at most one)

    def release_gate() -> None:
        while gated:
            gate.release(gated.pop(), len(prompt))

    try:
        if settings.mode == "colocated":
            worker = await _choose(lambda: policy.choose_decode(prompt, pool.loads("colocated")), j, wait_s,
                                   "no healthy colocated worker")
            use(worker)
            await _send(pool, worker, wm.Generate(rid, prompt, sampling))
            first_dispatch(worker)
        else:
            prefill = await _prefill_slot(j, prompt, pool, policy, gate, wait_s)
            gated.append(prefill)
            decode_worker = await _reserve(j, rid, prompt, pool, policy, settings, events, use, done_with, wait_s)
        while True:
            msg = await _next(events, j.deadline, pool, watched)
            if isinstance(msg, wm.Reserved):
                policy.record(prompt, prefill)
                use(prefill)
                kv = wm.KVDestination(msg.kv_address, msg.num_pages, msg.num_cached_pages, settings.kv_timeout_s)
                await _send(pool, prefill, wm.Prefill(rid, prompt, sampling, kv))
                first_dispatch(prefill)
                continue
            if isinstance(msg, wm.Failed):
                if msg.stage == "transfer":  # the KV never arrived whole: its sender may be gone
                    raise WorkerLost(f"KV transfer to {msg.worker_id} failed: {msg.reason}")
                raise RouterError(grpc.StatusCode.UNAVAILABLE, f"{msg.stage} failed on {msg.worker_id}: {msg.reason}")
            if isinstance(msg, wm.TransferEnded):
                if msg.state == "done":  # the prefill worker holds nothing more of this request
                    done_with(msg.worker_id)
                continue  # a failed transfer also reaches us as the decode worker's Failed
            if isinstance(msg, wm.FirstToken):
                release_gate()  # prefilled: the next prompt in the router's queue may go
                await _send(pool, decode_worker, wm.StartDecode(rid, prompt, msg.token_id, sampling))
                new_ids, reason = [msg.token_id], None
                if attempt == 0:
                    stream.num_cached = msg.num_cached_prompt_tokens
            elif isinstance(msg, wm.Tokens):
                new_ids, reason = list(msg.token_ids), msg.finish_reason if msg.finished else None
                if settings.mode == "colocated" and attempt == 0:  # disaggregated: the prefill side's count
                    stream.num_cached = msg.num_cached_prompt_tokens
            else:
                continue
            response = _respond(j, stream, new_ids, reason)
            if response is not None:
                yield response
            if stream.ended:
                return
    finally:
        release_gate()
        pool.unsubscribe(rid)
        pool.release(rid)
        if not stream.done or stream.stops.stopped:
            for worker in involved:  # cancel, deadline, error, lost worker or stop string: free every side
                try:
                    await pool.send(worker, wm.Abort(rid))
                except Exception:  # noqa: BLE001 - best effort; the workers' leases are the backstop
                    pass


def _respond(j: Journey, stream: _Stream, new_ids: list[int], reason: str | None) -> pb.GenerateResponse | None:
    """The client's next message for `new_ids` (None when there is nothing to send yet)."""
    if stream.ttft is None and new_ids:
        stream.ttft = time.monotonic() - stream.start
    stream.generated += new_ids
    text = stream.stops.push(stream.detok.push(new_ids))
    if stream.stops.stopped:
        reason = "stop"
    if reason is None:
        return pb.GenerateResponse(request_id=j.request_id, text=text, token_ids=new_ids) if text or new_ids else None
    if not stream.stops.stopped:  # the end of the stream: release what was held back
        text += stream.stops.push(stream.detok.flush())
        text += stream.stops.flush()
        reason = "stop" if stream.stops.stopped else reason
    stream.ended = True
    stream.done = reason != "abort"
    return pb.GenerateResponse(
        request_id=j.request_id, text=text, token_ids=new_ids, finish_reason=FINISH[reason],
        usage=pb.Usage(prompt_tokens=len(j.prompt), completion_tokens=len(stream.generated),
                       cached_prompt_tokens=stream.num_cached, ttft_s=stream.ttft or 0.0))


async def _choose(choose: Callable[[], str | None], j: Journey, wait_s: float, none_message: str) -> str:
    """A worker from the policy; a retry waits up to `wait_s` for one to become healthy."""
    give_up = min(time.monotonic() + wait_s, j.deadline)
    while True:
        worker = choose()
        if worker is not None:
            return worker
        if time.monotonic() >= give_up:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, none_message)
        await asyncio.sleep(0.1)


async def _prefill_slot(j: Journey, prompt: tuple[int, ...], pool: WorkerPool, policy: LeastLoadedPolicy,
                        gate: PrefillGate, wait_s: float) -> str:
    """A prefill worker with room for `prompt` (gate credit taken), waiting in the router's queue
    while every healthy one is full; UNAVAILABLE when none is healthy for `wait_s`."""
    give_up = time.monotonic() + wait_s

    def choose(full: set[str]) -> str | None:
        loads = pool.loads("prefill")
        if not any(w.healthy for w in loads) and time.monotonic() >= give_up:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "no healthy prefill worker")
        return policy.choose_prefill(prompt, [w for w in loads if w.worker_id not in full])

    return await gate.acquire(len(prompt), choose, j.deadline,
                              lambda: RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "request deadline expired"))


async def _reserve(j, rid, prompt, pool, policy, settings, events, use, done_with, wait_s) -> str:
    """Reserves decode pages, retrying while every decode worker is full (backpressure)."""
    while True:
        worker = await _choose(lambda: policy.choose_decode(prompt, pool.loads("decode")), j, wait_s,
                               "no healthy decode worker")
        use(worker)
        await _send(pool, worker, wm.ReserveKV(rid, prompt, settings.lease_s))
        msg = await _next(events, j.deadline, pool, {worker: pool.incarnation(worker)})
        if isinstance(msg, wm.Reserved):
            events.put_nowait(msg)  # let the main loop act on it
            return worker
        if isinstance(msg, wm.Failed):
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT if msg.stage == "reserve" else grpc.StatusCode.UNAVAILABLE,
                              msg.reason)
        done_with(worker)  # rejected: it holds nothing
        await asyncio.sleep(settings.reserve_retry_s)


async def _send(pool: WorkerPool, worker: str, message: object) -> None:
    """A command for an attempt; a worker that has left the pool (drained past its timeout) is lost."""
    try:
        await pool.send(worker, message)
    except LookupError as exc:
        raise WorkerLost(str(exc)) from None


async def _next(events: asyncio.Queue, deadline: float, pool: WorkerPool, watched: dict[str, str | None],
                check_every_s: float = 0.25) -> object:
    """The next event for this request. Fails fast, instead of waiting out the deadline, when a
    worker holding part of the request stops sending heartbeats."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "request deadline expired")
        try:
            return await asyncio.wait_for(events.get(), min(remaining, check_every_s))
        except TimeoutError:
            dead = sorted(w for w in watched if not pool.healthy(w))
            if dead:
                raise WorkerLost(f"worker {', '.join(dead)} stopped responding (no heartbeat)") from None
            replaced = sorted(w for w, incarnation in watched.items() if pool.incarnation(w) != incarnation)
            if replaced:  # a new process under the old id knows nothing of this attempt
                raise WorkerLost(f"worker {', '.join(replaced)} was replaced") from None
