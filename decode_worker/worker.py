"""The decode role: reserve pages, receive KV into them, join requests to the decode batch,
stream tokens back to the router.

Driven by a loop that calls `handle(message)` for router messages and `step()` repeatedly.
`ReserveKV` brings the prompt and its sampling settings; the request joins the batch the moment
the receiver reports its transfer DONE (the final frame carries the first token). `Generate`
brings a prompt the router placed here (router/placement/: the prefill pool was busier, down,
or this worker already holds its prefix): it is computed here, chunked between decode steps,
and decoded in the same batch, as a colocated worker would. Meanwhile,
if nothing runs here, a draft model's prompt KV is computed (engine.run_ahead, from `step`),
beside the prefill worker computing the target's, so the request's first decode step carries
no prompt. Every
reservation ends exactly once: joined, cancelled by Abort, or dropped when its transfer fails or
its lease (the transfer's deadline) runs out, and the router hears Failed and may retry elsewhere. Lifecycle events
(reserved, transfer_received, joined, finished, aborted, failed) go to the structured log under
the router's request id (configs/logging_setup.py).
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable, Iterable

from configs.logging_setup import EventLog
from engine import LLMEngine, RequestOutput, SamplingParams
from engine.kv_transfer import BaseFrameReceiver, KVReceiver, TransferObserver, TransferState, poll
from proto.worker_messages import (
    Abort,
    Failed,
    Generate,
    Reserved,
    ReserveKV,
    ReserveRejected,
    Tokens,
)


def sampling_params(s) -> SamplingParams:
    return SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                          seed=s.seed, stop_token_ids=s.stop_token_ids, ignore_eos=s.ignore_eos,
                          logprobs=s.logprobs, speculative_method=s.speculative_method,
                          num_speculative_tokens=s.num_speculative_tokens)


def tokens_message(worker_id: str, out: RequestOutput) -> Tokens:
    return Tokens(out.request_id, worker_id, tuple(out.new_token_ids), tuple(out.new_logprobs), out.finished,
                  out.finish_reason.value if out.finish_reason else None, out.num_cached_prompt_tokens,
                  out.num_spec_proposed, out.num_spec_accepted)


def admit_whole_request(engine: LLMEngine, message: Generate, worker_id: str, emit: Callable[[object], None],
                        log: EventLog, **fields: object) -> None:
    """A whole request (prompt and decode) into `engine`, or Failed with the reason it refused."""
    try:
        engine.add_request(message.request_id, list(message.prompt_token_ids), sampling_params(message.sampling))
    except ValueError as exc:
        log.event("rejected", message.request_id, reason=str(exc))
        emit(Failed(message.request_id, worker_id, "prefill", str(exc)))
        return
    log.event("admitted", message.request_id, prompt_tokens=len(message.prompt_token_ids), **fields)


class DecodeWorker:
    batch_events = True  # a step's Tokens leave as one frame (cluster/serving_loop.py EventSink)

    def __init__(
        self,
        worker_id: str,
        engine: LLMEngine,
        kv_transport: BaseFrameReceiver,
        kv_address: str,
        emit: Callable[[object], None],
        clock: Callable[[], float] = time.monotonic,
        transfer_observer: TransferObserver | None = None,
        max_lease_s: float = 30.0,
        require_checksum: bool = False,
    ) -> None:
        """`max_lease_s`: the longest a reservation waits for its KV, whatever a ReserveKV asks."""
        self.worker_id = worker_id
        self.engine = engine
        self.kv_transport = kv_transport
        self.kv_address = kv_address
        self.emit = emit
        self.clock = clock
        self.max_lease_s = max_lease_s
        self.receiver = KVReceiver(engine.kv_cache, clock, transfer_observer, require_checksum)
        self.log = EventLog("decode", worker_id)
        # One record per request between ReserveKV and joining: its prompt and sampling settings.
        # The pages are the engine's reservation; the KV deadline is the receiver's.
        self._reserved: dict[str, ReserveKV] = {}
        # The KV sources this worker can no longer hear (address -> why), as of the last publish():
        # the heartbeat reports them, so the router sends their KV another way.
        self.dead_sources: dict[str, str] = {}
        # The requests this role holds anything for beyond the engine's own (reservations, KV
        # expected), as of the last publish(): a leak check reads it (WorkerHost.held_request_ids).
        self.held_ids: frozenset[str] = frozenset()

    def handle(self, message: object) -> None:
        if isinstance(message, ReserveKV):
            self._reserve(message)
        elif isinstance(message, Generate):
            self._generate(message)
        elif isinstance(message, Abort):
            if self._drop(message.request_id):
                self.log.event("aborted", message.request_id)
        else:
            raise ValueError(f"a decode worker does not take {type(message).__name__}")

    def step(self, idle_wait_s: float = 0.005) -> bool:
        """Computes some of a reserved request's draft prompt KV (while its KV is on the way and
        nothing runs), takes in arrived KV, joins ready requests, runs one decode step. Returns whether it did
        work; with nothing to run it waits up to idle_wait_s for KV instead of spinning."""
        ahead = self.take_kv(idle_wait_s)
        if not self.engine.has_unfinished_requests():
            return ahead
        self.emit_outputs(self.engine.step())
        return True

    def take_kv(self, idle_wait_s: float = 0.005) -> bool:
        """Computes some of a reserved request's draft prompt KV (while nothing runs), takes in
        arrived KV and joins the requests it completes; waits up to `idle_wait_s` for KV only
        when nothing runs here. Returns whether it computed draft KV."""
        ahead = self.engine.run_ahead()
        idle = not ahead and not self.engine.has_unfinished_requests() and self.receiver.num_pending > 0
        for outcome in poll(self.receiver, self.kv_transport, idle_wait_s if idle else 0.0):
            if outcome.state is not TransferState.DONE:
                self._fail(outcome.request_id, "transfer", f"KV transfer {outcome.state.value}: {outcome.detail}")
            elif outcome.first_token is None:
                self._fail(outcome.request_id, "transfer", "KV transfer done without a first token")
            else:
                self.log.event("transfer_received", outcome.request_id, first_token=outcome.first_token)
                self._join(outcome.request_id, outcome.first_token)
        return ahead

    def emit_outputs(self, outputs: Iterable[RequestOutput]) -> None:
        """An engine step's outputs, each streamed to the router as Tokens."""
        for out in outputs:
            self._emit_tokens(out)

    def publish(self) -> None:
        """What other threads read (heartbeats, status, metrics) made current; on this thread."""
        self.engine.publish_snapshot()
        self.publish_own()

    def publish_own(self) -> None:
        """This role's own state for other threads, beside the engine's snapshot."""
        self.dead_sources = self.kv_transport.link_errors()
        self.held_ids = frozenset(self._reserved.keys() | self.receiver.request_ids())

    def _emit_tokens(self, out: RequestOutput) -> None:
        if out.finished:
            self.log.event("finished", out.request_id, finish_reason=out.finish_reason.value,
                           completion_tokens=len(out.token_ids))
        self.emit(tokens_message(self.worker_id, out))

    def _reserve(self, message: ReserveKV) -> None:
        try:
            res = self.engine.handoff.reserve(message.request_id, list(message.prompt_token_ids))
        except ValueError as exc:
            self.emit(Failed(message.request_id, self.worker_id, "reserve", str(exc)))
            return
        if res is None:
            self.log.event("reserve_rejected", message.request_id, reason="no free KV pages")
            self.emit(ReserveRejected(message.request_id, self.worker_id, "no free KV pages"))
            return
        self.log.event("reserved", message.request_id, pages=len(res.page_ids), cached_pages=res.num_cached_pages)
        self._reserved[message.request_id] = message
        lease_s = min(message.lease_s, self.max_lease_s)  # pages are never held longer than configured
        token = secrets.token_hex(16)  # frames without it (forged, or another transfer's) are ignored
        self.receiver.expect(message.request_id, list(res.page_ids[res.num_cached_pages :]), lease_s, token)
        self.emit(Reserved(message.request_id, self.worker_id, self.kv_address, len(res.page_ids),
                           res.num_cached_pages, token))
        # A draft model's prompt KV is computed here while the prefill worker computes the
        # target's (step -> engine.run_ahead, only while nothing runs here), not in the request's
        # first decode step: this worker would only wait for the KV meanwhile.
        with contextlib.suppress(ValueError):  # settings the join refuses, saying why (_join)
            self.engine.expect_prefilled_request(message.request_id, list(message.prompt_token_ids),
                                                 sampling_params(message.sampling))

    def _generate(self, message: Generate) -> None:
        admit_whole_request(self.engine, message, self.worker_id, self.emit, self.log, placement="local")

    def _join(self, request_id: str, first_token: int) -> None:
        reserve = self._reserved.pop(request_id)
        try:
            out = self.engine.add_prefilled_request(request_id, list(reserve.prompt_token_ids), first_token,
                                                    sampling_params(reserve.sampling))
        except ValueError as exc:
            self.engine.abort_request(request_id)
            self.emit(Failed(request_id, self.worker_id, "decode", str(exc)))
            return
        self.log.event("joined", request_id)
        if out is not None:  # the first token already finished it
            self._emit_tokens(out)

    def reservation(self, request_id: str) -> ReserveKV | None:
        """The ReserveKV of a request whose KV has not arrived yet (None: no such reservation)."""
        return self._reserved.get(request_id)

    def fail_transfer(self, request_id: str, reason: str) -> None:
        """Ends a reservation as a failed KV transfer does (what `pdserve replay` re-drives)."""
        self._fail(request_id, "transfer", reason)

    def _fail(self, request_id: str, stage: str, reason: str) -> None:
        self._drop(request_id)
        self.log.event("failed", request_id, stage=stage, reason=reason)
        self.emit(Failed(request_id, self.worker_id, stage, reason))

    def _drop(self, request_id: str) -> bool:
        """Frees whatever this request holds here (reservation, expected KV, running sequence);
        False when it held nothing."""
        held = self.receiver.cancel(request_id)
        held = self._reserved.pop(request_id, None) is not None or held
        return self.engine.abort_request(request_id) or held
