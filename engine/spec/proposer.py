"""What a proposer of speculative tokens promises the engine (engine/spec/speculator.py calls it).

A proposer guesses the next tokens of decoding sequences; the target model computes those
positions in the sequence's next step and keeps only what its own sampling would have produced
(engine/spec/rejection.py), so a proposer changes speed, never output. Prompt lookup
(engine/spec/prompt_lookup.py) needs no model; a draft model (engine/spec/draft_proposer.py)
keeps its own KV through the same three calls; Medusa heads (engine/spec/medusa_proposer.py)
read the target's own hidden states, which the speculator hands to proposers that ask for them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.sequence import Sequence


@dataclass(frozen=True)
class Proposal:
    """Up to k proposed tokens for one sequence, following its last token."""

    token_ids: tuple[int, ...]
    # [len(token_ids), vocab] float32: the distribution each token was drawn from, for exact
    # rejection sampling (a draft model's softmax). None: every token is a point mass
    # (deterministic proposals: prompt lookup, greedy drafts).
    draft_probs: torch.Tensor | None = None
    # The method whose guesses these are, where it is not the request's own (a fallback method's
    # parts, engine/spec/fallback_proposer.py): metrics count acceptance by who proposed.
    proposed_by: str | None = None

    def __len__(self) -> int:
        return len(self.token_ids)


NO_PROPOSAL = Proposal(())


class BaseProposer(ABC):
    """Call order, per engine step, on the engine's own thread:
      0. `prefill(chunks)` before the step runs, for the sequences of a step small enough to
         speculate in that compute prompt tokens in it (sequence, number of tokens from its
         num_computed_tokens on), only for a proposer with `prefills`: a draft model computes
         its own KV of the same tokens then, in the step that prefills the target.
      1. `propose(seqs, max_num_tokens)` after the scheduler picked the step, for the decoding
         sequences that may speculate. Each sequence's tokens (prompt + output) are final up to
         its last token, whose KV is not yet computed; a proposal may be shorter than asked
         (empty: nothing to propose) and is never longer.
      2. `on_verified(seq, num_accepted)` after the step, for every sequence whose proposal was
         verified: its first `num_accepted` proposed tokens are now its own (a draft model keeps
         the KV of those and drops the rest). A proposal the step could not take (no free pages
         for it) gets `on_verified(seq, 0)` at once, during `plan`.
      2b. `keep_hidden(seq, row, num_tokens)` after every step that sampled the sequence, only for
         a proposer with `reads_hidden`: the target's final-norm hidden state of the row its newest
         token came from (a verification's: the last accepted token's), current while the
         sequence has `num_tokens` tokens. Called before the step's tokens are appended, so a
         sequence that finishes in that step is released after it.
      3. `release(seq)` when a sequence leaves the engine or is preempted (its state goes).
    Proposers hold no pages of the target's KV cache (a draft model has its own)."""

    method: str  # the name in configs (SpeculativeConfig.method) and in metric labels
    max_num_tokens: int | None = None  # the longest proposal it can make (None: no limit of its own)
    reads_hidden = False  # whether it wants `keep_hidden` (the target's hidden states)
    # Whether a proposal costs next to nothing to make, however long (no model runs for it): a
    # sequence alone in its step then always proposes its maximum k (engine/spec/adaptive.py).
    free_proposals = False
    # What guessing one token costs, over a plain decode step of the target (engine/spec/
    # guess_cost.py), for the adaptive k (engine/spec/adaptive.py); 0 for proposers without a model.
    guess_cost = 0.0
    prefills = False  # whether it wants `prefill` (it keeps KV of its own for the prompt)
    # Set by each `propose`: whether that call computed prompt tokens of its own KV (a draft
    # model's first catch-up where its prompt was not prefilled, as on a decode worker): a cost
    # once per request, which the cost policy must not charge to the method's steps.
    computed_prompt = False

    @abstractmethod
    def propose(self, seqs: Seq[Sequence], max_num_tokens: Seq[int]) -> list[Proposal]:
        """One proposal per sequence, at most max_num_tokens[i] tokens long."""

    def prefill(self, chunks: Seq[tuple[Sequence, int]]) -> None:  # noqa: B027 - optional hook
        pass

    def on_verified(self, seq: Sequence, num_accepted: int) -> None:  # noqa: B027 - optional hook
        pass

    def keep_hidden(self, seq: Sequence, row: torch.Tensor, num_tokens: int) -> None:  # noqa: B027 - optional hook
        pass

    def release(self, seq: Sequence) -> None:  # noqa: B027 - optional hook
        pass
