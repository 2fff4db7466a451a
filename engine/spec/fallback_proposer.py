"""A method made of two proposers: the first one's guesses where it has any, else the second's
(`prompt_lookup+draft`: prompt lookup's free n-gram guesses where the text repeats, the draft
model's where it does not). The speculator (engine/spec/speculator.py) calls it like any proposer;
it hands each sequence to `primary`, the ones left without a proposal to `fallback`, and routes
`on_verified` to whichever made the sequence's proposal.

Why: at concurrency 1 on code, prompt lookup finds a match in a good share of steps and costs
nothing; the draft is right more often but each guess costs a draft step (docs/benchmarks.md).
Running the draft only where prompt lookup has nothing keeps the free guesses free.

Each proposal is labelled with the method that made it (Proposal.proposed_by), so acceptance is
counted by who proposed. The fallback's k follows its own acceptance (a SpecState per sequence,
engine/spec/adaptive.py): the primary is free, so the method claims `free_proposals` like it
(a sequence alone proposes its maximum), and the fallback's own state keeps a draft that misses
from guessing k tokens every step. Both proposers are the engine's own instances (one draft model
and one set of draft pages for `draft` and `prompt_lookup+draft` requests alike); a draft twin
that skipped steps while prompt lookup proposed catches up in its next step (one prompt chunk).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import TYPE_CHECKING

from engine.spec.adaptive import SpecState
from engine.spec.proposer import NO_PROPOSAL, BaseProposer, Proposal

if TYPE_CHECKING:
    from engine.sequence import Sequence


class FallbackProposer(BaseProposer):
    free_proposals = True  # the primary's guesses are free; the fallback's k has its own state

    def __init__(self, primary: BaseProposer, fallback: BaseProposer, adaptive: bool = True) -> None:
        if primary.reads_hidden or fallback.reads_hidden:
            raise ValueError("a fallback method cannot combine proposers that read the target's hidden states")
        self.primary, self.fallback = primary, fallback
        self.method = f"{primary.method}+{fallback.method}"
        self.prefills = primary.prefills or fallback.prefills
        self.adaptive = adaptive
        self.guess_cost = primary.guess_cost  # the request's k: the fallback's follows its own cost
        self.fallback_states: dict[str, SpecState] = {}  # by request id: the fallback's own k
        # By request id: who made the sequence's pending proposal, and its length.
        self.pending: dict[str, tuple[BaseProposer, int]] = {}

    def propose(self, seqs: Seq[Sequence], max_num_tokens: Seq[int]) -> list[Proposal]:
        proposals = list(self.primary.propose(seqs, max_num_tokens))
        left: list[tuple[int, int]] = []  # (index in seqs, k) for the fallback
        for i, (seq, k, proposal) in enumerate(zip(seqs, max_num_tokens, proposals)):
            if len(proposal):
                self.pending[seq.request_id] = (self.primary, len(proposal))
                proposals[i] = replace(proposal, proposed_by=self.primary.method)
                continue
            state = self.fallback_states.get(seq.request_id)
            if state is None:
                state = self.fallback_states[seq.request_id] = SpecState(self.fallback.method, k, self.adaptive,
                                                                         self.fallback.guess_cost)
            state.max_k = max(state.max_k, k)  # (k may be capped lower by a request's room at first)
            k = min(k, state.next_k(num_step_seqs=len(seqs)))  # (the step's speculating sequences: a lower bound of its size)
            if k > 0:
                left.append((i, k))
        self.computed_prompt = self.primary.computed_prompt
        if left:
            made = self.fallback.propose([seqs[i] for i, _ in left], [k for _, k in left])
            self.computed_prompt |= self.fallback.computed_prompt
            for (i, _), proposal in zip(left, made):
                if len(proposal):
                    self.pending[seqs[i].request_id] = (self.fallback, len(proposal))
                    proposals[i] = replace(proposal, proposed_by=self.fallback.method)
        return [p if len(p) else NO_PROPOSAL for p in proposals]

    def prefill(self, chunks: Seq[tuple[Sequence, int]]) -> None:
        for proposer in (self.primary, self.fallback):
            if proposer.prefills:
                proposer.prefill(chunks)

    def on_verified(self, seq: Sequence, num_accepted: int) -> None:
        pending = self.pending.pop(seq.request_id, None)
        if pending is None:
            return
        proposer, num_proposed = pending
        if proposer is self.fallback and (state := self.fallback_states.get(seq.request_id)) is not None:
            state.record(num_proposed, num_accepted)
        proposer.on_verified(seq, num_accepted)

    def release(self, seq: Sequence) -> None:
        self.pending.pop(seq.request_id, None)
        self.fallback_states.pop(seq.request_id, None)
        self.primary.release(seq)
        self.fallback.release(seq)
