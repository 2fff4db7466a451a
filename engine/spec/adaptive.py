"""Per-request speculation state: how many tokens to propose next, from how the last ones fared.

A proposal the target rejects costs the compute of its positions and gains nothing, so each
request's k follows its own recent acceptance (engine/spec/speculator.py reads `next_k` before
proposing and calls `record` after verifying):
  - every proposed token accepted: k grows by one (up to the request's maximum);
  - some accepted: k shrinks to the accepted run plus one;
  - none accepted: k drops to one and the request pauses speculation for a few steps, the
    pause doubling on each further total miss (1, 2, 4, ... 16 steps) and reset by any hit.
The totals are the request's own (RequestOutput.num_spec_proposed / num_spec_accepted).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PAUSE_STEPS = 16


@dataclass
class SpecState:
    method: str  # the request's proposer
    max_k: int  # the request's (or the pool's) num_speculative_tokens
    adaptive: bool = True
    k: int = 0  # next proposal length (set to max_k on creation)
    pause_steps: int = 0  # steps left without speculation
    backoff_steps: int = 1  # the next pause after a total miss
    num_proposed: int = 0  # totals over the request's life
    num_accepted: int = 0
    num_verified: int = 0  # steps that verified a proposal

    def __post_init__(self) -> None:
        self.k = self.max_k

    def next_k(self, alone_and_free: bool = False) -> int:
        """Tokens to propose this step (0: not this step); counts down a pause. `alone_and_free`:
        the sequence is the step's only one and its proposer's guesses cost nothing to make: the
        maximum, whatever the pause (which keeps counting only in shared steps)."""
        if alone_and_free:
            return self.max_k
        if self.pause_steps > 0:
            self.pause_steps -= 1
            return 0
        return self.k if self.adaptive else self.max_k

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted
        self.num_verified += 1
        if not self.adaptive:
            return
        if num_accepted == num_proposed:
            # A short proposal fully accepted (the proposer had no more) is no reason to shrink.
            self.k = min(self.max_k, max(self.k, num_proposed + 1))
            self.backoff_steps = 1
        elif num_accepted > 0:
            self.k = min(self.max_k, num_accepted + 1)
            self.backoff_steps = 1
        else:
            self.k = 1
            self.pause_steps = self.backoff_steps
            self.backoff_steps = min(MAX_PAUSE_STEPS, 2 * self.backoff_steps)
