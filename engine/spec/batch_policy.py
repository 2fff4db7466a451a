"""How much speculation a step may carry, from how big the step already is (engine/spec/speculator.py
asks once per step, after the scheduler's choice and before any proposer runs).

Verifying k proposed tokens costs k more rows in the step; at low batch the step is bound by
reading the weights, so the rows are nearly free and every accepted token saves a whole step.
As the batch grows the step turns compute-bound (and on a CPU the per-sequence Python of
proposing and verifying is a fixed cost per row as well), so speculation is turned down:
  - `max_batch_seqs`: a step with more sequences than this (decodes and prompt chunks) gets no
    proposals at all, and no proposer runs for it: at saturation speculation costs nothing;
  - `max_batch_tokens`: below that, proposals fill at most what is left up to this many tokens
    in the step (and never past the scheduler's own token budget).
"""

from __future__ import annotations

from configs.engine import SpeculativeConfig


def proposal_budget(config: SpeculativeConfig, num_step_seqs: int, num_step_tokens: int,
                    max_num_batched_tokens: int) -> int:
    """Proposed tokens the step may add, over all its sequences (0: none this step).

    num_step_seqs / num_step_tokens: what the scheduler already put in the step."""
    if config.max_batch_seqs and num_step_seqs > config.max_batch_seqs:
        return 0
    budget = max_num_batched_tokens - num_step_tokens
    if config.max_batch_tokens:
        budget = min(budget, config.max_batch_tokens - num_step_tokens)
    return max(0, budget)
