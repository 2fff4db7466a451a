"""`pdserve replay DUMP`: a worker's flight recorder dump (proto/flight/) re-driven into
in-process twins, each request's terminal state compared with the recorded one.

Data flow: the dump's header names the role and its engine settings; the twin is that role's
real class (prefill_worker/worker.py, decode_worker/) on a fresh engine with the same settings,
its KV going over the in-process channel (engine/kv_transfer/inproc.py). The recorded commands
go in in their recorded order, and each only once the twin has sent as many events for its
request as the recorded worker had when the command came: what a command raced with (an Abort
after the first token, a second request behind a long prompt) meets the same state again. What
came from outside the command socket is re-driven from the record too:
  - decode: the KV. Where the record says a request's KV arrived, an in-process prefill twin
    computes the same prompt and ships it to the twin's reservation; where it says the transfer
    failed (the prefill worker died, the lease lapsed), the twin's transfer fails there too.
  - prefill: a transfer the record says did not complete fails on the twin's link.
A request's terminal state is finished (with its tokens), failed (at its stage), aborted,
rejected (no decode pages), or sent (prefill: first token, transfer done or not). Tokens are
compared where they are reproducible (greedy, or seeded sampling); a request whose opening
command fell out of the ring is not compared, one still in flight when the dump was taken is
replayed to its end and reported, not judged. Router dumps are summarised, not re-driven (the
router's decisions depend on the load it saw, which a dump does not hold).
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from configs import EngineConfig
from decode_worker.colocated import ColocatedWorker
from decode_worker.worker import DecodeWorker
from engine import LLMEngine
from engine.kv_transfer import BaseFrameSender
from engine.kv_transfer.destinations import KVDestinations
from engine.kv_transfer.frames import Frame
from engine.kv_transfer.inproc import InProcChannel
from engine.kv_transfer.links import KVLinks
from engine.kv_transfer.transport import TransportError
from prefill_worker.worker import PrefillWorker
from proto import worker_messages as wm
from proto.flight.dump import Dump

log = logging.getLogger(__name__)
OPENING = (wm.Generate, wm.ReserveKV, wm.Prefill)  # the command a request's record starts with
TWIN_ADDRESS = "inproc"  # where the twins' KV goes


@dataclass(frozen=True)
class Outcome:
    state: str  # finished, failed, aborted, rejected, sent, open
    detail: str = ""  # finish reason, failed stage, transfer done / not done
    token_ids: tuple[int, ...] = ()

    def __str__(self) -> str:
        return self.state + (f" ({self.detail})" if self.detail else "") + (
            f", {len(self.token_ids)} tokens" if self.token_ids else "")


def outcome_of(items: list[tuple[str, Any]]) -> Outcome:
    """The terminal state of one request from its messages in order: ("in", command) and
    ("out", event). The first terminal one decides."""
    tokens: list[int] = []
    for direction, msg in items:
        if direction == "in":
            if isinstance(msg, wm.Abort):
                return Outcome("aborted", "", tuple(tokens))
        elif isinstance(msg, wm.Tokens):
            tokens += msg.token_ids
            if msg.finished:
                return Outcome("finished", msg.finish_reason or "", tuple(tokens))
        elif isinstance(msg, wm.Failed):
            return Outcome("failed", msg.stage, tuple(tokens))
        elif isinstance(msg, wm.ReserveRejected):
            return Outcome("rejected")
        elif isinstance(msg, wm.FirstToken):
            tokens = [msg.token_id]
        elif isinstance(msg, wm.TransferEnded):
            return Outcome("sent", "transfer done" if msg.state == "done" else "transfer not done", tuple(tokens))
    return Outcome("open", "", tuple(tokens))


@dataclass(frozen=True)
class RequestReplay:
    request_id: str
    recorded: Outcome
    replayed: Outcome | None  # None: not replayed (a router's, or its opening command fell out of the ring)
    tokens_compared: bool
    summarised: bool = False  # a router's request: its recorded end only

    @property
    def verdict(self) -> str:
        if self.summarised:
            return "recorded (router)"
        if self.replayed is None:
            return "not compared (its start fell out of the ring)"
        if self.recorded.state == "open":
            return "in flight when dumped"
        same = (self.recorded.state, self.recorded.detail) == (self.replayed.state, self.replayed.detail)
        if same and self.tokens_compared:
            same = self.recorded.token_ids == self.replayed.token_ids
        return "same" if same else "DIFFERENT"


@dataclass
class ReplayReport:
    name: str
    component: str
    requests: list[RequestReplay] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def different(self) -> list[RequestReplay]:
        return [r for r in self.requests if r.verdict == "DIFFERENT"]

    def lines(self) -> Iterator[str]:
        counts: dict[str, int] = defaultdict(int)
        for r in self.requests:
            counts[r.verdict] += 1
        yield f"{self.name} ({self.component}): {len(self.requests)} requests; " + ", ".join(
            f"{n} {verdict}" for verdict, n in sorted(counts.items()))
        yield from (f"  note: {n}" for n in self.notes)
        width = max([len(r.request_id) for r in self.requests] + [10])
        yield f"  {'request':<{width}}  {'recorded':<34} {'replayed':<34} verdict"
        for r in self.requests:
            yield f"  {r.request_id:<{width}}  {str(r.recorded):<34} {str(r.replayed or '-'):<34} {r.verdict}"


@dataclass(frozen=True)
class _Input:
    request_id: str
    need: int  # events the recorded worker had sent for the request when this came
    command: Any = None  # a recorded command, or None for a KV outcome
    kv: str = ""  # decode: "arrived" or "failed: why"


def _reproducible(command: Any) -> bool:
    s = getattr(command, "sampling", None)
    return s is not None and (s.temperature == 0 or s.seed is not None)


def _engine_config(head: dict, notes: list[str]) -> EngineConfig:
    import torch

    raw = dict(head.get("header", {}).get("engine") or {})
    if head.get("header", {}).get("switchable"):
        raise ValueError(f"the dump of {head.get('worker_id')} is a switchable worker's (router.role_switching): "
                         "replaying one is not supported yet; its entries are in the file as JSON lines")
    if not raw:
        raise ValueError(f"the dump of {head.get('worker_id')} names no engine settings: it cannot be replayed")
    if str(raw.get("device", "cpu")).startswith("cuda") and not torch.cuda.is_available():
        raw["device"] = "cpu"
        notes.append("recorded on a GPU, replayed on the CPU")
    if raw.get("tensor_parallel_size", 1) * raw.get("pipeline_parallel_size", 1) > 1:
        raw["tensor_parallel_size"] = raw["pipeline_parallel_size"] = 1
        notes.append("recorded sharded, replayed on one shard")
    return EngineConfig.model_validate_json(json.dumps(raw))


class _FailingLink(BaseFrameSender):
    """The twin prefill worker's KV link: frames of `failing` requests fail as the record says
    their transfers did; the rest go to the in-process channel (and are dropped there)."""

    def __init__(self, inner: BaseFrameSender, failing: set[str]) -> None:
        self.inner, self.failing = inner, failing

    def send(self, frame: Frame) -> Callable[[], bool]:
        if frame.header.get("request_id") in self.failing:
            raise TransportError("replayed: the recorded transfer did not complete")
        return self.inner.send(frame)

    def flush(self, timeout_s: float) -> bool:
        return self.inner.flush(timeout_s)


class _Twin:
    """The recorded role, in-process: `items[request_id]` gathers what went in and came out."""

    def __init__(self, dump: Dump, notes: list[str]) -> None:
        self.component = dump.component
        self.items: dict[str, list[tuple[str, Any]]] = defaultdict(list)
        config = _engine_config(dump.head, notes)
        self.channel = InProcChannel()
        worker_id = dump.name
        self.prefill_twin: PrefillWorker | None = None
        self.reserved: dict[str, wm.Reserved] = {}
        if self.component == "colocated":
            self.role: Any = ColocatedWorker(worker_id, LLMEngine(config), self._emit)
        elif self.component == "decode":
            self.role = DecodeWorker(worker_id, LLMEngine(config), self.channel.receiver, TWIN_ADDRESS, self._emit)
            # The KV's source: the same prompt computed by a prefill worker of the same model.
            prefill_config = config.model_copy(update={"speculative": EngineConfig().speculative})
            self.prefill_twin = PrefillWorker("replay-prefill", LLMEngine(prefill_config),
                                              KVLinks(lambda address: self.channel.sender), self._emit_prefill,
                                              KVDestinations([TWIN_ADDRESS]))
        elif self.component == "prefill":
            failing = {e["request_id"] for e, msg in dump.messages()
                       if isinstance(msg, wm.TransferEnded) and msg.state != "done"}
            addresses = {msg.kv.address for _, msg in dump.messages() if isinstance(msg, wm.Prefill)}
            link = _FailingLink(self.channel.sender, failing)
            self.role = PrefillWorker(worker_id, LLMEngine(config), KVLinks(lambda address: link), self._emit,
                                      KVDestinations(addresses))
        else:
            raise ValueError(f"a {self.component} dump is not re-driven (only prefill, decode and colocated ones)")
        self._prefill_ended: set[str] = set()

    def _emit(self, msg: object) -> None:
        msg = wm.decode(wm.encode(msg))  # as it would cross the socket
        rid = getattr(msg, "request_id", None)
        if rid is None:
            return
        if isinstance(msg, wm.Reserved):
            self.reserved[rid] = msg
        self.items[rid].append(("out", msg))

    def _emit_prefill(self, msg: object) -> None:
        if isinstance(msg, wm.TransferEnded):
            self._prefill_ended.add(msg.request_id)

    def sent(self, request_id: str) -> int:
        return sum(1 for direction, _ in self.items[request_id] if direction == "out")

    def take(self, command: Any) -> None:
        self.items[command.request_id].append(("in", command))
        self.role.handle(command)
        if self.prefill_twin is not None and isinstance(command, wm.Abort):
            self.prefill_twin.handle(command)

    def step(self) -> bool:
        busy = bool(self.role.step())
        if self.component == "prefill":
            self.channel.receiver.recv(0.0)  # the KV went nowhere: drop it
        return busy

    def kv(self, request_id: str, outcome: str, step_limit: int) -> None:
        """Decode: the recorded KV outcome of `request_id`, made to happen to the twin."""
        reserve = self.role.reservation(request_id)
        reserved = self.reserved.get(request_id)
        if reserve is None or reserved is None:
            return  # the twin holds no reservation for it (its own outcome says why)
        if outcome != "arrived":
            self.role.fail_transfer(request_id, f"replayed: {outcome}")
            return
        assert self.prefill_twin is not None
        kv = wm.KVDestination(TWIN_ADDRESS, reserved.num_pages, reserved.num_cached_pages, 30.0,
                              reserved.transfer_token)
        self.prefill_twin.handle(wm.Prefill(request_id, reserve.prompt_token_ids, reserve.sampling, kv))
        for _ in range(step_limit):
            if request_id in self._prefill_ended or not self.prefill_twin.step():
                break


def _inputs(dump: Dump) -> list[_Input]:
    sent: dict[str, int] = defaultdict(int)
    out: list[_Input] = []
    for e in dump.entries:
        rid = e.get("request_id")
        if rid is None:
            continue
        kind = e["kind"]
        if kind == "out":
            sent[rid] += 1
        elif kind == "in" and "type" in (e.get("message") or {}):
            out.append(_Input(rid, sent[rid], command=wm.from_map(dict(e["message"]))))
        elif kind == "state" and dump.component == "decode":
            if e.get("event") == "transfer_received":
                out.append(_Input(rid, sent[rid], kv="arrived"))
            elif e.get("event") == "failed" and (e.get("fields") or {}).get("stage") == "transfer":
                out.append(_Input(rid, sent[rid], kv=f"failed: {(e.get('fields') or {}).get('reason', '')}"))
    return out


def recorded_items(dump: Dump) -> dict[str, list[tuple[str, Any]]]:
    items: dict[str, list[tuple[str, Any]]] = defaultdict(list)
    for e, msg in dump.messages():
        if e.get("request_id") is not None and e["kind"] in ("in", "out"):
            items[e["request_id"]].append((e["kind"], msg))
    return items


def router_ends(dump: Dump) -> dict[str, Outcome]:
    """Each request's end as the router logged it: finished (reason, tokens), an error (its gRPC
    status), or open."""
    ends: dict[str, Outcome] = {}
    for e in dump.entries:
        rid, fields = e.get("request_id"), e.get("fields") or {}
        if rid is None:
            continue
        if e["kind"] == "state" and e.get("event") == "finished":
            ends[rid] = Outcome("finished", str(fields.get("finish_reason", "")))
        elif e["kind"] == "state" and e.get("event") == "error":
            ends[rid] = Outcome("failed", str(fields.get("status", "")))
        else:
            ends.setdefault(rid, Outcome("open"))
    return ends


def replay(dump: Dump, step_limit: int = 20_000, idle_steps: int = 20) -> ReplayReport:
    """Re-drives `dump` into a twin of its worker; the report compares every request's end."""
    report = ReplayReport(dump.name, dump.component)
    recorded = recorded_items(dump)
    opening = {rid: items[0][1] for rid, items in recorded.items()
               if items and items[0][0] == "in" and isinstance(items[0][1], OPENING)}
    if dump.component == "router":
        report.notes.append("a router dump is summarised, not re-driven")
        report.requests = [RequestReplay(rid, end, None, False, summarised=True) for rid, end in router_ends(dump).items()]
        return report
    twin = _Twin(dump, report.notes)

    def run_until(done: Callable[[], bool]) -> None:
        idle = 0
        for _ in range(step_limit):
            if done():
                return
            idle = 0 if twin.step() else idle + 1
            if idle >= idle_steps:
                return

    for item in _inputs(dump):
        if item.request_id not in opening:
            continue  # its start fell out of the ring: nothing to re-drive it from
        run_until(lambda item=item: twin.sent(item.request_id) >= item.need)  # type: ignore[misc]
        if item.command is not None:
            twin.take(item.command)
        else:
            twin.kv(item.request_id, item.kv, step_limit)
    run_until(lambda: all(outcome_of(twin.items[rid]).state != "open" for rid in opening))
    for rid, items in recorded.items():
        if rid not in opening:
            report.requests.append(RequestReplay(rid, outcome_of(items), None, False))
            continue
        report.requests.append(RequestReplay(rid, outcome_of(items), outcome_of(twin.items[rid]),
                                             _reproducible(opening[rid])))
    return report
