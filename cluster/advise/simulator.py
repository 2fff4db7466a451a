"""A discrete-event simulator of one layout serving a request stream: what `pdserve advise`
predicts each layout's goodput with (report.py), from measured step costs (costs.py).

The model, per worker (the engine's continuous batching, engine/scheduler.py):
  - it runs steps back to back while it has work; a step computes up to its token budget of
    waiting prompt tokens, oldest prompt first (chunked prefill), and one token of each running
    sequence, and lasts StepCost.step_s(prompt tokens, sequences) x the core share it gets: with
    more busy workers than cores, each step is stretched by busy workers / cores;
  - a prompt whose last chunk a step computed has its first token at that step's end; on a
    decode or colocated worker it then decodes from the next step on, one token a step;
  - at most `max_seqs` sequences run; the rest wait for a free slot.
And per request, the router (router/placement/):
  - colocated: the worker with the fewest requests computes and decodes it;
  - disaggregated: placed remote (the prefill worker with the fewest queued tokens computes it,
    the KV's last chunk crosses the link, and it joins the decode worker with the fewest
    requests at that worker's next step) or local (that decode worker computes it), by
    `disaggregation`: always -> remote, never -> local, adaptive -> the router's own rule
    (router/placement/decide.py `choose`, fed the simulated queues and the measured rates).
Where the requests' token ids are known, each worker has a prefix cache of whole pages
(unbounded): a prompt computes only what its worker does not hold, and placement and decode
routing see the hits, as the router's KV block index does. What it leaves out: attention's growth
with context, cache eviction, the router's own CPU,
and time-sharing finer than whole steps. Its requests come out as loadgen RequestRecords, so
goodput and percentiles are computed exactly as `pdserve bench` computes them.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from cluster.advise.costs import Costs, LinkCost, StepCost
from loadgen.metrics import SLO, RequestRecord, Summary, summarize_run
from router.placement import cost_model
from router.placement.decide import LOCAL, SUFFIX, PlacementSettings, RemoteOption, choose


@dataclass(frozen=True)
class Request:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prompt: tuple[int, ...] | None = None  # its token ids where known: prefix-cache hits are modelled then


@dataclass(frozen=True)
class WorkerShape:
    role: str  # prefill, decode or colocated
    threads: int
    budget: int  # engine.max_num_batched_tokens
    max_seqs: int = 256  # engine.max_num_seqs
    page_size: int = 16  # engine.page_size: the prefix cache holds whole pages


@dataclass(frozen=True)
class Layout:
    name: str
    workers: tuple[WorkerShape, ...]
    cores: int
    disaggregation: str = "always"  # disaggregated layouts: always, adaptive or never

    @property
    def colocated(self) -> bool:
        return all(w.role == "colocated" for w in self.workers)


@dataclass
class _Req:
    spec: Request
    token_times: list[float] = field(default_factory=list)
    left: int = 0  # tokens still to decode


@dataclass
class _Prompt:
    req: _Req
    left: int  # prompt tokens not computed yet
    decode_on: _Worker | None = None  # remote: where it decodes once its KV is there
    started: bool = False  # its cache hit is looked up when its first chunk is scheduled, as the engine does


@dataclass
class _Worker:
    name: str
    shape: WorkerShape
    cost: StepCost
    prompts: deque[_Prompt] = field(default_factory=deque)
    running: list[_Req] = field(default_factory=list)
    waiting: deque[_Req] = field(default_factory=deque)  # prefilled elsewhere or here, no slot yet
    joining: int = 0  # remote requests placed here whose KV has not arrived
    busy: bool = False
    cache: set[tuple[int, ...]] = field(default_factory=set)  # whole-page prompt prefixes held (unbounded)

    def cached_tokens(self, prompt: tuple[int, ...] | None) -> int:
        """Of `prompt`, the leading whole pages this worker's prefix cache holds."""
        if prompt is None:
            return 0
        page, hit = self.shape.page_size, 0
        while hit + page <= len(prompt) and prompt[: hit + page] in self.cache:
            hit += page
        return hit

    def keep(self, prompt: tuple[int, ...] | None) -> None:
        if prompt is not None:
            page = self.shape.page_size
            self.cache.update(prompt[:k] for k in range(page, len(prompt) + 1, page))

    def has_work(self) -> bool:
        return bool(self.prompts or self.running or self.waiting)

    def queued_tokens(self) -> int:
        return sum(p.left for p in self.prompts)

    def requests(self) -> int:
        return len(self.running) + len(self.waiting) + self.joining + len(self.prompts)


class Simulation:
    def __init__(self, layout: Layout, costs: Costs, slo: SLO) -> None:
        self.layout, self.costs, self.slo = layout, costs, slo
        self.workers = [_Worker(f"{w.role}-{i}", w, costs.step(w.threads)) for i, w in enumerate(layout.workers)]
        self.settings = PlacementSettings(layout.disaggregation, tpot_target_s=slo.tpot_s)
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self.placements: dict[str, int] = {}

    def _at(self, t: float, kind: str, payload: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def run(self, requests: Sequence[Request]) -> list[RequestRecord]:
        reqs = [_Req(r) for r in sorted(requests, key=lambda r: r.arrival_s)]
        for req in reqs:
            self._at(req.spec.arrival_s, "arrive", req)
        while self._events:
            t, _, kind, payload = heapq.heappop(self._events)
            if kind == "arrive":
                assert isinstance(payload, _Req)
                self._place(payload)
            elif kind == "join":
                joining: tuple[_Worker, _Req] = payload  # type: ignore[assignment]
                joining[0].joining -= 1
                joining[0].waiting.append(joining[1])
            elif kind == "step_end":
                self._end_step(t, payload)  # type: ignore[arg-type]
            self._start_idle(t)
        return [RequestRecord(r.spec.arrival_s, tuple(r.token_times), len(r.token_times), r.spec.prompt_tokens)
                for r in reqs]

    # -- the router ------------------------------------------------------------------------------
    def _place(self, req: _Req) -> None:
        req.left = req.spec.output_tokens - 1
        n = req.spec.prompt_tokens
        by_role = {role: [w for w in self.workers if w.shape.role == role] for role in ("prefill", "decode", "colocated")}
        prompt = req.spec.prompt
        if self.layout.colocated:
            worker = min(by_role["colocated"], key=lambda w: (-w.cached_tokens(prompt), w.requests(), w.name))
            worker.prompts.append(_Prompt(req, self._uncached(worker, req)))
            self._count("colocated")
            return
        # Remote KV goes to the decode worker holding the longest prefix, then the least busy
        # (router/placement/: cache-aware decode routing).
        decode = min(by_role["decode"], key=lambda w: (-w.cached_tokens(prompt), w.requests(), w.name))
        remotes = [RemoteOption(cost_model.PrefillSide(w.name, w.cost.prefill_tokens_per_s(w.shape.budget),
                                                       w.queued_tokens(), w.cached_tokens(prompt)),
                                cost_model.LinkCost(self.costs.link.latency_s, self.costs.link.bytes_per_s))
                   for w in by_role["prefill"]]
        locals_ = [cost_model.DecodeSide(w.name, w.cost.prefill_tokens_per_s(w.shape.budget),
                                         w.cost.step_s(0, len(w.running)), w.queued_tokens(), len(w.running),
                                         w.cached_tokens(prompt))
                   for w in by_role["decode"]]
        placement = choose(self.settings, n, self.costs.kv_bytes_per_token, remotes, locals_)
        assert placement is not None  # every simulated worker is healthy
        self._count(placement.kind)
        if placement.kind in (LOCAL, SUFFIX):
            local = next(w for w in by_role["decode"] if w.name == placement.decode)
            local.prompts.append(_Prompt(req, self._uncached(local, req)))
            return
        prefill = next(w for w in by_role["prefill"] if w.name == placement.prefill)
        decode.joining += 1
        prefill.prompts.append(_Prompt(req, self._uncached(prefill, req), decode_on=decode))

    @staticmethod
    def _uncached(worker: _Worker, req: _Req) -> int:
        return cost_model.uncached(req.spec.prompt_tokens, worker.cached_tokens(req.spec.prompt))

    def _count(self, kind: str) -> None:
        self.placements[kind] = self.placements.get(kind, 0) + 1

    # -- the engines -----------------------------------------------------------------------------
    def _start_idle(self, t: float) -> None:
        for w in self.workers:
            if not w.busy and w.has_work():
                self._start_step(t, w)

    def _start_step(self, t: float, w: _Worker) -> None:
        while w.waiting and len(w.running) < w.shape.max_seqs:
            w.running.append(w.waiting.popleft())
        budget, chunks = w.shape.budget, []
        for prompt in w.prompts:
            if budget <= 0:
                break
            if not prompt.started:  # a prompt placed behind another with its prefix hits what that one left
                prompt.started = True
                prompt.left = cost_model.uncached(prompt.req.spec.prompt_tokens, w.cached_tokens(prompt.req.spec.prompt))
            take = min(budget, prompt.left)
            chunks.append((prompt, take))
            budget -= take
        decoding = list(w.running)
        busy = sum(1 for x in self.workers if x.busy) + 1
        share = max(1.0, busy / self.layout.cores)
        w.busy = True
        duration = w.cost.step_s(w.shape.budget - budget, len(decoding)) * share
        self._at(t + duration, "step_end", (w, chunks, decoding))

    def _end_step(self, t: float, step: tuple[_Worker, list[tuple[_Prompt, int]], list[_Req]]) -> None:
        w, chunks, decoding = step
        w.busy = False
        for req in decoding:
            req.token_times.append(t)
            req.left -= 1
            if req.left <= 0:
                w.running.remove(req)
        for prompt, n in chunks:
            prompt.left -= n
            if prompt.left > 0:
                continue
            w.prompts.remove(prompt)
            req = prompt.req
            w.keep(req.spec.prompt)
            if prompt.decode_on is not None:
                prompt.decode_on.keep(req.spec.prompt)  # the decode worker caches the pages it receives
            req.token_times.append(t)  # the first token
            if req.left <= 0:
                if prompt.decode_on is not None:
                    prompt.decode_on.joining -= 1
                continue
            if prompt.decode_on is None:
                w.waiting.append(req)  # decodes here from the next step
            else:
                tail = min(prompt.req.spec.prompt_tokens, w.shape.budget) * self.costs.kv_bytes_per_token
                self._at(t + self.costs.link.transfer_s(tail), "join", (prompt.decode_on, req))


@dataclass(frozen=True)
class Prediction:
    layout: str
    summary: Summary
    placements: dict[str, int]


def simulate(layout: Layout, costs: Costs, requests: Sequence[Request], slo: SLO) -> Prediction:
    """`requests` through `layout`: their goodput, attainment, TTFT/TPOT percentiles under `slo`."""
    if not requests:
        raise ValueError("nothing to simulate: the workload has no requests")
    sim = Simulation(layout, costs, slo)
    records = sim.run(requests)
    start = min(r.arrival for r in records)
    end = max((r.token_times[-1] for r in records if r.token_times), default=start)
    return Prediction(layout.name, summarize_run(records, end - start, slo), dict(sim.placements))


__all__ = ["Costs", "Layout", "LinkCost", "Prediction", "Request", "StepCost", "WorkerShape", "simulate"]
