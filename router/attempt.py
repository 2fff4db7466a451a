"""One attempt at a request (router/journey.py runs one, and another after a lost worker):
place the prompt (router/placement/: on a prefill worker with its KV shipped, or on the decode
worker itself), choose workers, send it, relay their token events to the client as responses,
and free everything the attempt took when it ends, however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import replace

import grpc

from proto import pdserve_pb2 as pb
from proto import worker_messages as wm
from router.journey_state import Journey, JourneySettings, Pool, RouterError, Stream, WorkerLost
from router.placement.decide import Placement
from router.placement.placer import Placer
from router.policy import LeastLoadedPolicy
from router.prefill_gate import PrefillGate
from router.ttft_stages import KvHandoff, TtftBreakdown

log = logging.getLogger(__name__)
FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


class Attempt:
    """One try at the rest of a request: the prompt plus what the client already has, under its
    own id, placed and routed now. It owns what it takes (the events subscription, the workers it
    involved, the prefill gate credit, its place in a decode worker's local queue) and `close`
    frees all of it: Abort to every involved worker unless the stream finished normally. Two
    paths, a whole request on one worker (colocated, or a prompt placed on its decode worker) and
    the disaggregated one, share one relay from token events to client responses."""

    def __init__(self, j: Journey, number: int, stream: Stream, pool: Pool, policy: LeastLoadedPolicy,
                 settings: JourneySettings, dispatched: list, gate: PrefillGate, placer: Placer) -> None:
        self.j, self.stream, self.pool, self.policy, self.settings, self.gate = j, stream, pool, policy, settings, gate
        self.placer = placer
        self.rid = j.request_id if number == 0 else f"{j.request_id}.retry{number}"
        self.first = number == 0
        self.number = number
        self.prompt = j.prompt + tuple(stream.generated)
        self.sampling = replace(j.sampling, max_tokens=j.sampling.max_tokens - len(stream.generated))
        self.wait_s = settings.retry_wait_s if number > 0 else 0.0
        self.dispatched = dispatched  # the request's one-shot on_dispatch callback, until a first dispatch
        self.events = pool.subscribe(self.rid)
        self.involved: set[str] = set()  # workers that may hold something of this attempt: Abort them at the end
        self.watched: dict[str, str | None] = {}  # workers whose death (or replacement) ends it -> incarnation
        self.gated: str | None = None  # the prefill worker whose gate credit this attempt holds
        self.kv_route: str | None = None  # where the prefill worker sends this attempt's KV
        self.queued_local: str | None = None  # the decode worker whose local queue counts this prompt

    async def run(self) -> AsyncIterator[pb.GenerateResponse]:
        path = self._colocated() if self.settings.mode == "colocated" else self._disaggregated()
        try:
            async with contextlib.aclosing(path) as responses:
                async for response in responses:
                    yield response
        finally:
            await self.close()

    async def _colocated(self) -> AsyncGenerator[pb.GenerateResponse, None]:
        hashes = self.pool.blocks.prompt_hashes(self.prompt)

        def choose() -> str | None:
            loads = self.pool.loads("colocated")
            cached = self.pool.blocks.cached_tokens(hashes, [w.worker_id for w in loads])
            return self.policy.choose_decode(self.prompt, loads, cached)

        worker = await _choose(choose, self.j, self.wait_s, "no healthy colocated worker")
        self.stream.placement = "colocated"
        async for response in self._whole(worker):
            yield response

    async def _whole(self, worker: str) -> AsyncGenerator[pb.GenerateResponse, None]:
        """The whole request on `worker`: a colocated one, or a decode worker the prompt was placed on."""
        await self._dispatch(worker, wm.Generate(self.rid, self.prompt, self.sampling))
        while not self.stream.ended:
            msg = await self._next()
            if not self._sent_by(msg, worker):
                continue
            if isinstance(msg, wm.Failed):
                self._fail(msg)
            elif isinstance(msg, wm.Tokens):
                self._dequeue_local()  # prefilled: the decode worker's own queue is shorter by it
                if self.first:
                    self.stream.num_cached = msg.num_cached_prompt_tokens
                self._count_spec(msg)
                async for response in self._relay([_tokens(msg)]):
                    yield response

    async def _place(self, hashes: list[int]) -> Placement:
        """Where this attempt's prompt is computed (router/placement/), waiting while no worker
        can take it (a retry waits up to retry_wait_s for a healthy one). A remote placement
        returns holding the prefill gate's credit on its prefill worker; while it waits for that
        room, it moves to a decode worker as soon as computing it there is the cheaper choice."""
        give_up = min(time.monotonic() + self.wait_s, self.j.deadline)
        n = len(self.prompt)
        while True:
            placement = self.placer.place(self.pool, n, hashes, self.gate.waiting_tokens)
            if placement is not None:
                break
            if time.monotonic() >= give_up:
                raise RouterError(grpc.StatusCode.UNAVAILABLE, "no healthy decode worker")
            await asyncio.sleep(0.1)
        if not placement.remote:
            return placement
        moved: list[Placement] = []

        def reconsider(ahead_tokens: int) -> bool:
            again = self.placer.place(self.pool, n, hashes, ahead_tokens)
            if again is not None and not again.remote:
                moved.append(again)
                return True
            return False

        prefill = await _prefill_slot(self.j, self.prompt, self.pool, self.policy, self.gate, self.wait_s,
                                      hashes, reconsider)
        if prefill is None:
            return moved[-1]
        self.gated = prefill
        return replace(placement, prefill=prefill)

    async def _disaggregated(self) -> AsyncGenerator[pb.GenerateResponse, None]:
        hashes = self.pool.blocks.prompt_hashes(self.prompt)
        placement = await self._place(hashes)
        self.placer.record(self.rid, self.j.client_id, placement)
        self.stream.placement = placement.kind
        if not placement.remote:
            assert placement.decode is not None  # a local placement names its decode worker
            self.placer.local.add(placement.decode, len(self.prompt))
            self.queued_local = placement.decode
            async for response in self._whole(placement.decode):
                yield response
            return
        prefill = self.gated
        assert prefill is not None  # a remote placement holds its prefill worker's gate credit
        decode = await self._reserve(prefill, hashes)
        # Which worker may say what: a message naming another sender is not this attempt's.
        senders = {wm.Reserved: decode, wm.Tokens: decode, wm.FirstToken: prefill, wm.TransferEnded: prefill}
        # The decode worker joins the request when its KV lands and may stream before the prefill
        # worker's FirstToken is read here (two sockets): hold its tokens back until then.
        early: list[wm.Tokens] | None = []
        while not self.stream.ended:
            msg = await self._next()
            if not self._sent_by(msg, *([senders[type(msg)]] if type(msg) in senders else [prefill, decode])):
                continue
            if isinstance(msg, wm.Reserved):
                self._check_kv_address(msg)
                address = self._route(prefill, decode)
                kv = wm.KVDestination(address, msg.num_pages, msg.num_cached_pages, self.settings.kv_timeout_s,
                                      msg.transfer_token)
                await self._dispatch(prefill, wm.Prefill(self.rid, self.prompt, self.sampling, kv))
            elif isinstance(msg, wm.Failed):
                if msg.stage == "transfer" and self.kv_route is not None and early is None:
                    # prefilled, yet the KV never arrived whole: the link may be dead
                    self.pool.suspect(prefill, self.kv_route)
                self._fail(msg)
            elif isinstance(msg, wm.TransferEnded):
                if msg.state == "done":  # the prefill worker holds nothing more of this request
                    self.stream.stages.mark_kv_sent()
                    self._done_with(msg.worker_id)
                else:  # the KV could not be sent (a dead link): retry now on another way, not at the lease's end
                    if self.kv_route is not None:
                        self.pool.suspect(prefill, self.kv_route)
                    raise WorkerLost(f"KV transfer from {prefill} to {decode} ({self.kv_route}) {msg.state}")
            elif isinstance(msg, wm.FirstToken):
                self._release_gate()  # prefilled: the next prompt in the router's queue may go
                if self.first:
                    self.stream.num_cached = msg.num_cached_prompt_tokens
                first = ([msg.token_id], None, [] if msg.logprob is None else [msg.logprob])
                pending, early = [first, *(_tokens(t) for t in early or ())], None
                async for response in self._relay(pending):
                    yield response
                if len(pending) > 1:  # the decode worker's tokens came first: they reach the client now
                    self.stream.stages.mark_decode_first()
            elif isinstance(msg, wm.Tokens):
                self._count_spec(msg)
                self.stream.stages.mark_decode_first()  # held back or not, the decode worker has joined
                if early is not None:
                    early.append(msg)
                    continue
                async for response in self._relay([_tokens(msg)]):
                    yield response

    def _count_spec(self, msg: wm.Tokens) -> None:
        """The request's speculative totals on this attempt's worker (cumulative per message)."""
        self.stream.spec_counts[self.number] = (msg.spec_proposed_tokens, msg.spec_accepted_tokens)

    async def _relay(self, pending: list[TokenEvent]) -> AsyncIterator[pb.GenerateResponse]:
        """Token events -> client responses (detokenized, stop strings applied), until the end."""
        for new_ids, reason, logprobs in pending:
            response = respond(self.j, self.stream, new_ids, reason, logprobs)
            if response is not None:
                yield response
            if self.stream.ended:
                return

    async def _reserve(self, prefill: str, hashes: list[int]) -> str:
        """Decode pages for the prompt on a decode worker `prefill` has a KV link to (the one
        caching most of it, within the policy's load cap: fewest pages to move), retrying while
        every such worker is full (backpressure); returns the decode worker that reserved them."""
        def choose() -> str | None:
            loads = self.pool.loads("decode")
            usable = [w for w in loads if self.pool.kv_route(prefill, w.worker_id) is not None]
            if any(w.healthy for w in loads) and not any(w.healthy for w in usable):
                raise WorkerLost(f"no KV link from {prefill} to a healthy decode worker")
            cached = self.pool.blocks.cached_tokens(hashes, [w.worker_id for w in usable])
            return self.policy.choose_decode(self.prompt, usable, cached)

        while True:
            worker = await _choose(choose, self.j, self.wait_s, "no healthy decode worker")
            self._use(worker)
            await _send(self.pool, worker, wm.ReserveKV(self.rid, self.prompt, self.settings.lease_s, self.sampling))
            watched = {worker: self.pool.incarnation(worker)}
            while not self._sent_by(msg := await _next(self.events, self.j.deadline, self.pool, watched), worker):
                pass
            if isinstance(msg, wm.Reserved):
                self.events.put_nowait(msg)  # the path acts on it
                return worker
            if isinstance(msg, wm.Failed):
                code = grpc.StatusCode.INVALID_ARGUMENT if msg.stage == "reserve" else grpc.StatusCode.UNAVAILABLE
                raise RouterError(code, msg.reason)
            self._done_with(worker)  # rejected: it holds nothing
            await asyncio.sleep(self.settings.reserve_retry_s)

    async def _dispatch(self, worker: str, message: object) -> None:
        """The prompt goes to the worker that computes it; the first dispatch ends the queue time."""
        self._use(worker)
        self.stream.stages.mark_sent()
        await _send(self.pool, worker, message)
        while self.dispatched:
            self.dispatched.pop()(worker)

    def _sent_by(self, msg: object, *workers: str) -> bool:
        """Whether `msg` comes from one of `workers`; an event under this attempt's id from any
        other sender is dropped and logged (it cannot be a reply to what this attempt sent)."""
        sender = getattr(msg, "worker_id", None)
        if sender in workers:
            return True
        log.warning("request %s: dropped %s from %s, which this attempt did not ask", self.rid,
                    type(msg).__name__, sender)
        return False

    def _check_kv_address(self, msg: wm.Reserved) -> None:
        """The prefill worker will push this request's KV (the prompt itself) wherever the
        reservation says: only to the KV endpoint the cluster started that decode worker with.
        Another address (a worker bound elsewhere than it was told, or one sending what it should
        not) fails this attempt before any prefill, and is counted; close() frees the pages."""
        known = self.pool.kv_address(msg.worker_id)
        if msg.kv_address == known:
            return
        why = (f"decode worker {msg.worker_id} reserved pages at KV address {msg.kv_address[:100]!r}, "
               f"not at its known KV endpoint {known!r}")
        self.pool.reject("kv_address", f"request {self.rid}: {why}")
        raise RouterError(grpc.StatusCode.UNAVAILABLE, f"{why}: the prompt was not sent to prefill")

    def _route(self, prefill: str, decode: str) -> str:
        """Where `prefill` sends `decode`'s KV now (its own address, or its fallback while the
        primary link is down); a pair with no way left is lost (the attempt is retried)."""
        route = self.pool.kv_route(prefill, decode)
        if route is None:
            raise WorkerLost(f"the KV link from {prefill} to {decode} went down")
        if route != self.pool.kv_address(decode):
            log.warning("request %s: KV link %s -> %s is down; sending its KV to the fallback %s", self.rid,
                        prefill, decode, route)
        self.kv_route = route
        return route

    def _next(self):
        return _next(self.events, self.j.deadline, self.pool, self.watched)

    @staticmethod
    def _fail(msg: wm.Failed) -> None:
        if msg.stage == "transfer":  # the KV never arrived whole: its sender may be gone
            raise WorkerLost(f"KV transfer to {msg.worker_id} failed: {msg.reason}")
        raise RouterError(grpc.StatusCode.UNAVAILABLE, f"{msg.stage} failed on {msg.worker_id}: {msg.reason}")

    def _use(self, worker: str) -> None:
        self.involved.add(worker)
        self.watched[worker] = self.pool.incarnation(worker)
        self.pool.involve(self.rid, worker)

    def _done_with(self, worker: str) -> None:
        """`worker` holds nothing more of this attempt."""
        self.involved.discard(worker)
        self.watched.pop(worker, None)
        self.pool.uninvolve(self.rid, worker)

    def _release_gate(self) -> None:
        if self.gated is not None:
            self.gate.release(self.gated, len(self.prompt))
            self.gated = None

    def _dequeue_local(self) -> None:
        if self.queued_local is not None:
            self.placer.local.done(self.queued_local, len(self.prompt))
            self.queued_local = None

    async def close(self) -> None:
        self._release_gate()
        self._dequeue_local()
        self.pool.unsubscribe(self.rid)
        self.pool.release(self.rid)
        if not self.stream.done or self.stream.stops.stopped:
            for worker in self.involved:  # cancel, deadline, error, lost worker or stop string: free every side
                try:
                    await self.pool.send(worker, wm.Abort(self.rid))
                except Exception:  # noqa: BLE001 - best effort; the workers' leases are the backstop
                    pass


# What one worker event adds to the stream: token ids, the finish reason if it ends it, and the
# tokens' log-probabilities (when the request asked for them).
TokenEvent = tuple[list[int], str | None, list[float]]


def _tokens(msg: wm.Tokens) -> TokenEvent:
    return list(msg.token_ids), msg.finish_reason if msg.finished else None, list(msg.logprobs)


def respond(j: Journey, stream: Stream, new_ids: list[int], reason: str | None,
            logprobs: list[float] | None = None) -> pb.GenerateResponse | None:
    """The client's next message for `new_ids` (None when there is nothing to send yet);
    `logprobs`, one per id, travel with them when the request asked."""
    logprobs = logprobs or []
    if new_ids:
        stream.stages.mark_first_token()  # set once: later tokens leave it
    if len(new_ids) == 1 or not stream.stops.stop:
        text = stream.stops.push(stream.detok.push(new_ids))
    else:
        # Several tokens at once (speculative decoding accepts runs): one at a time, so the
        # ones after a stop string are neither sent nor counted, as if they came one by one.
        text = ""
        for i, token in enumerate(new_ids):
            text += stream.stops.push(stream.detok.push([token]))
            if stream.stops.stopped:
                new_ids, logprobs = new_ids[: i + 1], logprobs[: i + 1]
                break
    stream.generated += new_ids
    if stream.stops.stopped:
        reason = "stop"
    if reason is None:
        if not (text or new_ids):
            return None
        return pb.GenerateResponse(request_id=j.client_id, text=text, token_ids=new_ids, logprobs=logprobs)
    if not stream.stops.stopped:  # the end of the stream: release what was held back
        text += stream.stops.push(stream.detok.flush())
        text += stream.stops.flush()
        reason = "stop" if stream.stops.stopped else reason
    stream.ended = True
    stream.done = reason != "abort"
    return pb.GenerateResponse(
        request_id=j.client_id, text=text, token_ids=new_ids, logprobs=logprobs, finish_reason=FINISH[reason],
        usage=pb.Usage(prompt_tokens=len(j.prompt), completion_tokens=len(stream.generated),
                       cached_prompt_tokens=stream.num_cached, ttft_s=stream.ttft or 0.0, placement=stream.placement,
                       ttft_breakdown=_breakdown_pb(stream.stages.ttft_breakdown()),
                       kv_handoff=_handoff_pb(stream.stages.kv_handoff()),
                       spec_proposed_tokens=sum(p for p, _ in stream.spec_counts.values()),
                       spec_accepted_tokens=sum(a for _, a in stream.spec_counts.values())))


def _breakdown_pb(b: TtftBreakdown | None) -> pb.TtftBreakdown | None:
    return None if b is None else pb.TtftBreakdown(queued_s=b.queued_s, prefill_s=b.prefill_s,
                                                   transfer_s=b.transfer_s, decode_wait_s=b.decode_wait_s)


def _handoff_pb(h: KvHandoff | None) -> pb.KvHandoff | None:
    return None if h is None else pb.KvHandoff(transfer_s=h.transfer_s, decode_wait_s=h.decode_wait_s)


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


async def _prefill_slot(j: Journey, prompt: tuple[int, ...], pool: Pool, policy: LeastLoadedPolicy,
                        gate: PrefillGate, wait_s: float, hashes: list[int],
                        reconsider: Callable[[int], bool]) -> str | None:
    """A prefill worker with room for `prompt` (gate credit taken; the one caching most of it,
    within the policy's load cap), waiting in the router's queue while every healthy one is full;
    None when `reconsider` moved the prompt elsewhere; UNAVAILABLE when none is healthy for `wait_s`
    and `reconsider` has nowhere else for it."""
    give_up = time.monotonic() + wait_s
    # Set at the head of the queue with no healthy prefill worker past give_up. Not raised there:
    # the prefill worker may have died while this prompt waited (it was placed remote when one
    # was up), and the gate asks `reconsider` next, which moves it to a decode worker if any.
    stranded = [False]

    def choose(full: set[str]) -> str | None:
        loads = pool.loads("prefill")
        if not any(w.healthy for w in loads):
            stranded[0] = time.monotonic() >= give_up
            return None
        open_ = [w for w in loads if w.worker_id not in full]
        return policy.choose_prefill(prompt, open_, pool.blocks.cached_tokens(hashes, [w.worker_id for w in open_]))

    def elsewhere(ahead_tokens: int) -> bool:
        if reconsider(ahead_tokens):
            return True
        if stranded[0]:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "no healthy prefill worker")
        return False

    return await gate.acquire(len(prompt), choose, j.deadline,
                              lambda: RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "request deadline expired"),
                              reconsider=elsewhere)


async def _send(pool: Pool, worker: str, message: object) -> None:
    """A command for an attempt; a worker that has left the pool (drained past its timeout) is lost."""
    try:
        await pool.send(worker, message)
    except LookupError as exc:
        raise WorkerLost(str(exc)) from None


async def _next(events: asyncio.Queue, deadline: float, pool: Pool, watched: dict[str, str | None],
                check_every_s: float = 0.25) -> object:
    """The next event for this request. Fails fast, instead of waiting out the deadline, when a
    worker holding part of the request stops sending heartbeats."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "request deadline expired")
        try:
            # Not asyncio.wait_for: on Python 3.11 it swallows a cancel that lands in the loop turn
            # the event arrives, and the request of a client gone then runs to its end.
            async with asyncio.timeout(min(remaining, check_every_s)):
                return await events.get()
        except TimeoutError:
            dead = sorted(w for w in watched if not pool.healthy(w))
            if dead:
                raise WorkerLost(f"worker {', '.join(dead)} stopped responding (no heartbeat)") from None
            replaced = sorted(w for w, incarnation in watched.items() if pool.incarnation(w) != incarnation)
            if replaced:  # a new process under the old id knows nothing of this attempt
                raise WorkerLost(f"worker {', '.join(replaced)} was replaced") from None
