"""Speculative decoding inside the engine's step: propose before the model runs, verify after.

    sched = scheduler.schedule()
    speculator.plan(sched, scheduler)      # decodes get proposals: 1 + k tokens to compute each
    hidden, sampled = runner.execute_hidden(...)  # k + 1 rows for a speculating sequence, 1 otherwise
    results = speculator.sample(runner.logits(hidden), sampled, hidden)   # verified tokens (1..k+1)
                                           # per sequence; Medusa's get the row of their newest token
    ... the engine appends them (stopping at a stop token / max_tokens), then
    scheduler.commit_drafts(seq, num_accepted)     # KV of rejected positions dropped, pages freed

`plan` first hands the step's prompt chunks to proposers that keep KV of their own (a draft
model prefills its twin beside the target: engine/spec/draft_proposer.py). It proposes only
for sequences whose next token is an ordinary decode (never a prompt chunk,
a recomputation after preemption, or a prefill worker's held request), only in steps of at most
`max_batch_seqs` sequences and then within what is left of the step's token budget and under
`max_batch_tokens` (a bigger step is compute-bound: verification would cost more than it saves;
engine/spec/batch_policy.py), only for methods that pay at the step's size as measured
(`cost_policy`, engine/spec/cost_policy.py: the engine brackets each step with `begin_step` /
`end_step` so its time is known; a seeded request is exempt, as its random draws depend on
whether it proposed and a timing-driven choice would make it unrepeatable), only where free pages allow (speculation never
preempts), and never more tokens than the request may still emit. A request's method and k come
from its SamplingParams, else the engine's SpeculativeConfig, and k adapts to its acceptance
(engine/spec/adaptive.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from configs.engine import SpeculativeConfig
from engine.sampler import sample
from engine.spec.adaptive import SpecState
from engine.spec.batch_policy import proposal_budget
from engine.spec.cost_policy import CostPolicy
from engine.spec.prompt_lookup import PromptLookupProposer
from engine.spec.proposer import BaseProposer
from engine.spec.rejection import rejection_sample, target_probs, verify_greedy

if TYPE_CHECKING:
    from engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
    from engine.sequence import Sequence


@dataclass
class SpecCounts:
    num_proposed: int = 0  # proposed tokens verified
    num_accepted: int = 0  # of which accepted
    num_verified: int = 0  # sequence-steps that verified a proposal (mean accepted length's denominator)


@dataclass
class SpecStepStats:
    """One step's verifications by method (engine/metrics/worker_metrics.py counts them)."""

    # By the method that made the proposals (a fallback method's parts apart: Proposal.proposed_by).
    by_method: dict[str, SpecCounts] = field(default_factory=dict)
    # The requests' methods (proposer keys) whose proposals were verified: what the cost policy
    # measures (it decides per request method, whichever part of it proposed).
    verified_methods: set[str] = field(default_factory=set)

    def add(self, method: str, num_proposed: int, num_accepted: int) -> None:
        counts = self.by_method.setdefault(method, SpecCounts())
        counts.num_proposed += num_proposed
        counts.num_accepted += num_accepted
        counts.num_verified += 1


@dataclass(frozen=True)
class Sampled:
    """What one sequence's rows of a step produced."""

    token_ids: list[int]  # 1 + accepted proposals (the last one the target's own)
    logprobs: list[float]  # raw log-probability of each, where asked (NaN elsewhere)
    num_accepted: int  # proposals kept (0 without a proposal)


def build_proposers(config: SpeculativeConfig) -> dict[str, BaseProposer]:
    """Every method a request may ask for, whatever the engine's default ("none" has none)."""
    return {PromptLookupProposer.method: PromptLookupProposer(config.ngram_min, config.ngram_max)}


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposers: dict[str, BaseProposer] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.config = config
        self.proposers = build_proposers(config) if proposers is None else proposers
        self.step_stats = SpecStepStats()  # of the latest step
        self.totals: dict[str, SpecCounts] = {}  # lifetime, by the method that proposed
        self.cost = CostPolicy() if config.cost_policy else None
        self.clock = clock  # seconds; a test injects its own
        self._step: _StepRecord | None = None  # the current step, while the cost policy measures it
        # A decode worker's requests whose KV is on its way, by request id: the sequence as it
        # will join (its prompt alone), num_computed_tokens counting what `prefill_ahead` did.
        self._ahead: dict[str, Sequence] = {}

    # -- the step's time (cost policy) ----------------------------------------------------------
    def begin_step(self) -> None:
        """The engine's step starts (before scheduling)."""
        self._step = _StepRecord(self.clock()) if self.cost is not None else None

    def end_step(self) -> None:
        """The engine's step is done (tokens appended): a step of decodes alone is measured."""
        step, self._step = self._step, None
        if self.cost is None or step is None or not step.num_seqs or not step.all_decodes:
            return
        verified = self.step_stats.verified_methods
        if step.methods <= verified:  # a proposer that ran and proposed nothing: neither side's step
            self.cost.record(verified, step.num_seqs, step.num_tokens, self.clock() - step.start)

    # -- before the step ----------------------------------------------------------------------
    def state_of(self, seq: Sequence) -> SpecState | None:
        """The sequence's speculation state, made on first use; None when it does not speculate."""
        if seq.spec is None:
            p = seq.params
            method = p.speculative_method or self.config.method
            k = self.config.num_tokens if p.num_speculative_tokens is None else p.num_speculative_tokens
            if method not in self.proposers or k == 0 or seq.hold_kv:
                return None
            seq.spec = SpecState(method, k, self.config.adaptive, self.proposers[method].guess_cost)
        return seq.spec

    def plan(self, out: SchedulerOutput, scheduler: Scheduler) -> None:
        """Adds proposals to the step's decodes in place (out.scheduled entries are replaced)."""
        self.step_stats = SpecStepStats()  # this step's, filled by `sample`
        step = self._step
        if step is not None:
            step.num_seqs = len(out.scheduled)
            step.all_decodes = not out.preempted and all(_is_decode(s) for s in out.scheduled)
        if out.preempted:  # pages are short: no speculative work this step
            return
        self._prefill(out)
        budget = proposal_budget(self.config, len(out.scheduled), out.num_tokens, scheduler.max_num_batched_tokens)
        if budget <= 0:  # a big step: no proposer runs (engine/spec/batch_policy.py)
            return
        wanted: dict[str, list[tuple[int, int]]] = {}  # method -> [(index in out.scheduled, k)]
        paying: dict[str, bool] = {}  # method -> whether it proposes in this step (the cost policy's call)
        for index, s in enumerate(out.scheduled):
            if budget <= 0:
                break
            seq = s.seq
            if not _is_decode(s) or (state := self.state_of(seq)) is None:
                continue
            if state.method not in paying:
                paying[state.method] = self.cost is None or self.cost.should_propose(state.method, len(out.scheduled))
            if not paying[state.method] and seq.params.seed is None:
                continue  # (a seeded request's draws follow its proposals: it must repeat whatever the clock says)
            room = seq.num_tokens_left
            proposer = self.proposers[state.method]
            alone_and_free = len(out.scheduled) == 1 and proposer.free_proposals
            k = min(state.next_k(alone_and_free, len(out.scheduled)), room - 1, budget)  # the step emits up to k + 1 tokens
            cap = proposer.max_num_tokens
            k = k if cap is None else min(k, cap)
            if k > 0:
                wanted.setdefault(state.method, []).append((index, k))
                budget -= k
        for method, items in wanted.items():
            proposer = self.proposers[method]
            if step is not None:
                step.methods.add(method)
            proposals = proposer.propose([out.scheduled[i].seq for i, _ in items], [k for _, k in items])
            if step is not None and proposer.computed_prompt:  # a prompt chunk in all but name: not measured
                step.all_decodes = False
            for (index, _), proposal in zip(items, proposals):
                s = out.scheduled[index]
                if not len(proposal):
                    continue
                if scheduler.allocate_drafts(s.seq, len(proposal)):
                    out.scheduled[index] = s.with_draft(proposal, method)
                else:  # no pages for it: as if all rejected (a draft model drops its guesses' KV)
                    proposer.on_verified(s.seq, 0)

    def _prefill(self, out: SchedulerOutput) -> None:
        """Hands the step's prompt chunks to the proposers that keep KV of their own (a draft
        model computes the same tokens now, beside the target), in steps small enough to speculate
        in and where the cost policy has the method proposing at this size: elsewhere it would not
        propose after them either (a proposer catches up when it first proposes)."""
        chunks: dict[str, list[tuple[Sequence, int]]] = {}  # method -> [(sequence, tokens this step)]
        for s in out.scheduled:
            if s.draft is not None or _is_decode(s) or (state := self.state_of(s.seq)) is None:
                continue
            if self.proposers[state.method].prefills:
                chunks.setdefault(state.method, []).append((s.seq, s.num_new_tokens))
        for method, items in chunks.items():
            if self._prefill_pays(method, len(out.scheduled)):
                self.proposers[method].prefill(items)

    def _prefill_pays(self, method: str, num_step_seqs: int) -> bool:
        """Whether a proposer's own prompt KV is worth computing for a request of `method` in a
        step of `num_step_seqs` sequences: only where it would propose after it (within
        `max_batch_seqs`, and where the cost policy has the method on at that size)."""
        limit = self.config.max_batch_seqs
        if limit and num_step_seqs > limit:
            return False
        return self.cost is None or self.cost.favours(method, num_step_seqs)

    # -- after the step -----------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, sampled: list[ScheduledSeq], hidden: torch.Tensor | None = None
               ) -> list[Sampled]:
        """logits: [rows, vocab], 1 + len(draft) rows per sampled sequence, in order; hidden:
        [rows, hidden] the final-norm hidden states they came from, for proposers that read them."""
        if all(s.draft is None for s in sampled):  # the plain path: one row each
            if self._step is not None:
                self._step.num_tokens = len(sampled)
            tokens, logprobs = sample(logits, [s.seq.params for s in sampled], [s.seq.generator for s in sampled])
            plain_results = [Sampled([t], [lp], 0) for t, lp in zip(tokens, logprobs)]
            if hidden is not None:
                self._keep_hidden(hidden, sampled, list(range(len(sampled))), plain_results)
            return plain_results
        starts, row = [], 0
        for s in sampled:
            starts.append(row)
            row += 1 + s.num_draft_tokens
        plain = [i for i, s in enumerate(sampled) if s.draft is None]
        results: list[Sampled | None] = [None] * len(sampled)
        if plain:
            rows = torch.tensor([starts[i] for i in plain])
            tokens, logprobs = sample(logits[rows], [sampled[i].seq.params for i in plain],
                                      [sampled[i].seq.generator for i in plain])
            for i, t, lp in zip(plain, tokens, logprobs):
                results[i] = Sampled([t], [lp], 0)
        for i, s in enumerate(sampled):
            if s.draft is not None:
                results[i] = self._verify(s, logits[starts[i] : starts[i] + 1 + s.num_draft_tokens])
        done = [r for r in results if r is not None]
        if self._step is not None:
            self._step.num_tokens = sum(len(r.token_ids) for r in done)
        if hidden is not None:
            self._keep_hidden(hidden, sampled, starts, done)
        return done

    def _keep_hidden(self, hidden: torch.Tensor, sampled: list[ScheduledSeq], starts: list[int],
                     results: list[Sampled]) -> None:
        """Hands each sequence of a hidden-reading method the row its newest token came from: its
        first row plus the proposals it accepted (the last accepted token's row gave the bonus)."""
        if not any(p.reads_hidden for p in self.proposers.values()):
            return
        readers = []  # (sequence, its proposer, row, tokens it will have)
        for s, start, result in zip(sampled, starts, results):
            state = self.state_of(s.seq)
            if state is not None and (proposer := self.proposers[state.method]).reads_hidden:
                readers.append((s.seq, proposer, start + result.num_accepted, s.seq.num_tokens + len(result.token_ids)))
        if not readers:
            return
        rows = hidden[torch.tensor([row for _, _, row, _ in readers])]  # a copy: the step's tensor can go
        for (seq, proposer, _, num_tokens), row in zip(readers, rows):
            proposer.keep_hidden(seq, row, num_tokens)

    def _verify(self, s: ScheduledSeq, logits: torch.Tensor) -> Sampled:
        seq, draft = s.seq, s.draft
        assert draft is not None and seq.spec is not None
        params = seq.params
        if params.greedy:
            tokens, accepted = verify_greedy(logits, draft.token_ids)
        else:
            tokens, accepted = rejection_sample(target_probs(logits, params), draft.token_ids, draft.draft_probs,
                                                seq.generator)
        logprobs = [float("nan")] * len(tokens)
        if params.logprobs:
            picked = torch.log_softmax(logits[: len(tokens)], dim=-1).gather(1, torch.tensor(tokens)[:, None])
            logprobs = picked[:, 0].tolist()
        seq.spec.record(len(draft), accepted)
        label = draft.proposed_by or s.spec_method  # who proposed (a fallback method's part)
        self.step_stats.add(label, len(draft), accepted)
        self.step_stats.verified_methods.add(s.spec_method)
        total = self.totals.setdefault(label, SpecCounts())
        total.num_proposed += len(draft)
        total.num_accepted += accepted
        total.num_verified += 1
        self.proposers[s.spec_method].on_verified(seq, accepted)
        return Sampled(tokens, logprobs, accepted)

    def release(self, seq: Sequence) -> None:
        """The sequence left the engine or was preempted: its proposer forgets it."""
        if seq.spec is not None:
            self.proposers[seq.spec.method].release(seq)

    # -- a decode worker's requests, before their KV arrives ------------------------------------
    def expect(self, seq: Sequence) -> None:
        """`seq` (its prompt alone) will join once its KV arrives: where its method's proposer keeps
        KV of its own, `prefill_ahead` computes the prompt's meanwhile, as `_prefill` does beside a
        colocated target's prefill."""
        state = self.state_of(seq)
        if state is not None and self.proposers[state.method].prefills:
            self._ahead[seq.request_id] = seq

    def prefill_ahead(self, num_step_seqs: int, max_tokens: int) -> bool:
        """Computes up to `max_tokens` of an expected request's prompt through its proposer, where
        it would propose in a step of `num_step_seqs` sequences (the batch threshold and the cost
        policy, as for `_prefill`); returns whether any was. Outside a step: the cost policy never
        charges it to one."""
        for seq in self._ahead.values():
            method = seq.spec.method if seq.spec is not None else ""
            todo = min(max_tokens, seq.num_prompt_tokens - seq.num_computed_tokens)
            if todo <= 0 or not self._prefill_pays(method, num_step_seqs):
                continue
            self.proposers[method].prefill([(seq, todo)])  # (from wherever its KV ends: pages short, later)
            seq.num_computed_tokens += todo
            return True
        return False

    def joined(self, request_id: str) -> None:
        """The expected request joined: what was computed ahead is its sequence's now (a
        proposer keys its state by request id), and the rest is caught up when it proposes."""
        self._ahead.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """The expected request will not join (aborted, its transfer failed or its lease ran
        out): what its proposer holds for it is freed."""
        seq = self._ahead.pop(request_id, None)
        if seq is not None:
            self.release(seq)


@dataclass
class _StepRecord:
    """What the cost policy learns about one step."""

    start: float  # the clock when the step began
    num_seqs: int = 0  # sequences scheduled (0: nothing ran)
    all_decodes: bool = False  # every one an ordinary decode (no prompt chunk, no preemption, no proposer's prompt)
    methods: set[str] = field(default_factory=set)  # whose proposers ran (step_stats: whose proposals were verified)
    num_tokens: int = 0  # emitted (verified tokens included)


def _is_decode(s: ScheduledSeq) -> bool:
    """An ordinary decode: one token, the newest, whose sampling follows a generated token."""
    seq = s.seq
    return (s.num_new_tokens == 1 and seq.num_computed_tokens == seq.num_tokens - 1
            and seq.num_tokens > seq.num_prompt_tokens)
