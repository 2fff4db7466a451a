"""The prefill role: run prompts, send the first token to the router at once, ship the KV.

Driven by a loop (a socket runner, or a test) that calls `handle(message)` for each message
from the router and `step()` repeatedly. Each step runs one engine step, then ships every page
that became complete to its decode worker (so the transfer overlaps chunked prefill), and
ends the transfers of prompts that are done: their held pages are released exactly once,
whatever the transfer's outcome. A Prefill whose KV destination is not one of the cluster's
decode endpoints (engine/kv_transfer/destinations.py) is refused before anything is computed or
connected: that request fails, counted in `rejected`, and the worker serves on. Lifecycle events
(admitted, prefill_done, transfer_done, rejected) go to the structured log under the router's
request id (configs/logging_setup.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from configs.logging_setup import EventLog
from engine import LLMEngine, RequestOutput, SamplingParams
from engine.kv_transfer import KVSender, TransferState, TransportError
from engine.kv_transfer.destinations import KVDestinations
from engine.kv_transfer.links import KVLinks, LinkState
from proto.worker_messages import Abort, Failed, FirstToken, Prefill, TransferEnded


@dataclass
class _Job:
    message: Prefill
    sender: KVSender
    pages_sent: int = 0  # destination pages sent so far (after skip)
    first_token: int | None = None  # sampled when the prefill is done; travels in the final KV frame

    @property
    def prefill_done(self) -> bool:
        return self.first_token is not None


class PrefillWorker:
    # A step's first tokens leave as they are made, not with the step's other events: the step
    # ships KV after them, and the router streams a first token as soon as it has it.
    batch_events = False

    def __init__(
        self,
        worker_id: str,
        engine: LLMEngine,
        links: KVLinks,
        emit: Callable[[object], None],
        destinations: KVDestinations,
        pages_per_frame: int = 8,
        max_transfer_s: float = 30.0,
    ) -> None:
        """`links`: the KV senders, one per decode endpoint (engine/kv_transfer/links.py), kept
        open to every destination so their states reach the router; `destinations`: the decode
        endpoints KV may go to (kept current by whoever started this worker); `max_transfer_s`:
        the longest a KV transfer (and the KV it holds here) may last, whatever a Prefill asks."""
        self.worker_id = worker_id
        self.destinations = destinations
        self.rejected: dict[str, int] = {}  # refused Prefill commands by reason
        self.max_transfer_s = max_transfer_s
        self.engine = engine
        self.links = links
        self.emit = emit
        self.pages_per_frame = pages_per_frame
        self._jobs: dict[str, _Job] = {}
        self.log = EventLog("prefill", worker_id)
        self.queued_tokens = 0  # num_queued_tokens as of the last publish(): what other threads read
        self.link_states: tuple[LinkState, ...] = ()  # as of the last publish(): the heartbeat reports them
        self.held_ids: frozenset[str] = frozenset()  # jobs and transfers, as of the last publish() (leak checks)

    @property
    def num_queued_tokens(self) -> int:
        """Prompt tokens accepted and not yet prefilled (the router's load signal)."""
        return sum(len(j.message.prompt_token_ids) for j in self._jobs.values() if not j.prefill_done)

    def publish(self) -> None:
        """What other threads read (heartbeats, status, metrics) made current; on this thread."""
        self.engine.publish_snapshot()
        self.publish_own()

    def publish_own(self) -> None:
        """This role's own state for other threads, beside the engine's snapshot (a switchable
        worker, cluster/role_switch/, publishes the engine once for both of its roles)."""
        self.queued_tokens = self.num_queued_tokens
        self.links.keep(self.destinations.addresses)  # a link to every destination, before it is needed
        self.link_states = self.links.states()
        self.held_ids = frozenset(self._jobs.keys() | self.links.request_ids())

    def handle(self, message: object) -> None:
        if isinstance(message, Prefill):
            self._start(message)
        elif isinstance(message, Abort):
            self._abort(message.request_id)
        else:
            raise ValueError(f"a prefill worker does not take {type(message).__name__}")

    def step(self) -> bool:
        """One engine step plus KV shipping; False when there was nothing to do."""
        if not self._jobs:
            return False
        self.take_outputs(self.engine.step())
        self.ship()
        return True

    def owns(self, request_id: str) -> bool:
        """Whether `request_id` is one of this role's prefill jobs (its engine output is a first token)."""
        return request_id in self._jobs

    def take_outputs(self, outputs: Iterable[RequestOutput]) -> None:
        """An engine step's outputs: each finished prompt of a job sends its first token at once."""
        for out in outputs:
            job = self._jobs.get(out.request_id)
            if job is None:
                continue
            job.first_token = out.new_token_ids[0]
            self.log.event("prefill_done", out.request_id, prompt_tokens=out.num_prompt_tokens,
                           cached_prompt_tokens=out.num_cached_prompt_tokens)
            self.emit(FirstToken(out.request_id, self.worker_id, out.new_token_ids[0],
                                 out.new_logprobs[0] if out.new_logprobs else None,
                                 out.num_cached_prompt_tokens))

    def ship(self) -> None:
        """Every job's newly complete pages to its decode worker; the transfers of finished prompts end."""
        for request_id, job in list(self._jobs.items()):
            self._ship(request_id, job)

    def _start(self, message: Prefill) -> None:
        if not self.destinations.allows(message.kv.address):
            # Checked first: a refused request has taken no pages and opened no connection.
            self.rejected["unknown_kv_destination"] = self.rejected.get("unknown_kv_destination", 0) + 1
            reason = self.destinations.refusal(message.kv.address)
            self.log.event("rejected", message.request_id, level=logging.WARNING, reason=reason)
            self.emit(Failed(message.request_id, self.worker_id, "prefill", reason))
            return
        s = message.sampling
        params = SamplingParams(max_tokens=1, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                seed=s.seed, ignore_eos=True, logprobs=s.logprobs)
        try:
            self.engine.add_request(message.request_id, list(message.prompt_token_ids), params, hold_kv=True)
        except ValueError as exc:
            self.log.event("rejected", message.request_id, reason=str(exc))
            self.emit(Failed(message.request_id, self.worker_id, "prefill", str(exc)))
            return
        self.log.event("admitted", message.request_id, prompt_tokens=len(message.prompt_token_ids),
                       decode=message.kv.address, pages_to_send=message.kv.num_pages - message.kv.skip_pages)
        sender = self.links.sender(message.kv.address)
        sender.begin(message.request_id, min(message.kv.timeout_s, self.max_transfer_s), message.kv.token)
        self._jobs[message.request_id] = _Job(message, sender)

    def _ship(self, request_id: str, job: _Job) -> None:
        """Sends the destination pages whose KV is complete; ends the transfer when all are."""
        kv = job.message.kv
        pages, num_tokens = self.engine.computed_kv(request_id)
        page_size = self.engine.config.page_size
        # Full pages only while prefill runs; the last, partial page once it is done.
        ready = -(-num_tokens // page_size) if job.prefill_done else num_tokens // page_size
        ready = min(ready, kv.num_pages) - kv.skip_pages
        try:
            while job.pages_sent < ready:
                n = min(self.pages_per_frame, ready - job.pages_sent)
                first = kv.skip_pages + job.pages_sent
                job.sender.send_cache_pages(request_id, job.pages_sent, self.engine.kv_cache, pages[first : first + n])
                job.pages_sent += n
        except TransportError as exc:
            self._end(request_id, job, job.sender.abort(request_id, str(exc)))
            return
        if job.prefill_done:
            self._end(request_id, job, job.sender.finish(request_id, job.first_token))

    def _end(self, request_id: str, job: _Job, state: TransferState) -> None:
        del self._jobs[request_id]
        self.engine.abort_request(request_id)  # frees the held pages (or the running request)
        self.log.event("transfer_done", request_id, state=state.value, pages_sent=job.pages_sent)
        self.emit(TransferEnded(request_id, self.worker_id, state.value))

    def _abort(self, request_id: str) -> None:
        job = self._jobs.pop(request_id, None)
        if job is not None:
            job.sender.abort(request_id, "aborted by the router")
        if self.engine.abort_request(request_id) or job is not None:
            self.log.event("aborted", request_id)
