"""Per-request speculation state: how many tokens to propose next, from the request's recent
acceptance and what a proposed token costs.

engine/spec/speculator.py reads `next_k` before proposing and calls `record` after verifying.
A proposed token costs its verification row and, for a proposer that runs a model, its guess;
it pays only when accepted, and the j-th one is kept only if all before it were. So from the
request's acceptance rate a (the share of its proposed tokens accepted, recent verifications
weighing most) the next k is the one that makes the most tokens per unit of time:

    tokens(k) = 1 + a + a^2 + ... + a^k      (the target's own token, then each accepted run)
    cost(k)   = 1 + STEP_OVERHEAD + k * (VERIFY_ROW_COST * n + guess_cost)   (plain steps)

for a sequence in a step of n sequences: its share of a plain step is 1/n of it, while each of
its extra rows costs what one row does (a CPU step is compute-bound past a few rows), so
speculation turns down as the batch grows; a guess is made for all of the step's sequences at
once, so `guess_cost` (the proposer's, over a target step: engine/spec/guess_cost.py) stays.
A high rate gives the maximum k, a middling one fewer. Where not even one token pays, the
request pauses: 1, 2, 4 ... 16 steps without proposing after that one, each pause ended by a
one-token probe that re-measures the rate, the pause doubling while the rate says it does not
pay and reset once it does.
This replaced a rule that shrank k to the last accepted run plus one and paused after any total
miss: on builtin:code-small's held-out code a draft's acceptance is high but its misses come in
short bursts, and that rule spent a quarter of a request's steps not proposing
(docs/benchmarks.md, "An adaptive k from the acceptance rate").
The totals are the request's own (RequestOutput.num_spec_proposed / num_spec_accepted).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PAUSE_STEPS = 16
# What a step costs whatever its k, over a plain step's forward. The engine's own work around a
# step (scheduling, sampling, outputs) is under 0.1 of it (builtin:code-small, one sequence,
# 2-core CPU); 0.5 because acceptance comes in runs: after a right guess the next is more often
# right than the rate says, so the geometric tokens(k) undercounts long proposals, and a higher
# fixed cost favours them. Replaying the target's greedy outputs with builtin:code-draft's
# guesses, 0.5 chose k's 2-3% faster than 0.1 (docs/benchmarks.md).
STEP_OVERHEAD = 0.5
# One extra verification row, over a plain step: at one sequence the step reads the same weights
# for 1 + k rows (builtin:code-small, 2-core AVX-512 CPU: 5 rows 1.44x one row, 9 rows 2.18x).
VERIFY_ROW_COST = 0.1
# Recent verifications weigh most: each one's evidence is multiplied by this at every new one.
DECAY = 0.8
# Before any verification: as if 3 of 4 proposed tokens had been accepted (this evidence decays too).
PRIOR_ACCEPTED, PRIOR_REJECTED = 3.0, 1.0


def best_k(acceptance: float, max_k: int, token_cost: float) -> int:
    """The k in 0..max_k with the most expected tokens per unit of step time (0: do not propose);
    `token_cost`: one proposed token's, in plain steps of the sequence's share."""
    best, best_rate = 0, 1.0 / (1.0 + STEP_OVERHEAD)
    tokens = 1.0
    for k in range(1, max_k + 1):
        tokens += acceptance ** k
        rate = tokens / (1.0 + STEP_OVERHEAD + k * token_cost)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


@dataclass
class SpecState:
    method: str  # the request's proposer
    max_k: int  # the request's (or the pool's) num_speculative_tokens
    adaptive: bool = True
    guess_cost: float = 0.0  # the proposer's guess of one token, over a plain target step
    accepted: float = PRIOR_ACCEPTED  # recent accepted tokens (decayed)
    rejected: float = PRIOR_REJECTED  # recent verifications that rejected one (decayed): a proposal ends at its first miss
    pause_steps: int = 0  # steps left without speculation
    backoff_steps: int = 1  # the next pause while speculation does not pay
    probe_due: bool = False  # a pause just ended: propose one token, whatever the step, to re-measure
    num_proposed: int = 0  # totals over the request's life
    num_accepted: int = 0
    num_verified: int = 0  # steps that verified a proposal

    @property
    def acceptance(self) -> float:
        """The recent share of proposed tokens accepted."""
        return self.accepted / (self.accepted + self.rejected)

    def token_cost(self, num_step_seqs: int = 1) -> float:
        """One proposed token's cost, over the sequence's share of a plain step of that many sequences."""
        return VERIFY_ROW_COST * num_step_seqs + self.guess_cost

    def next_k(self, alone_and_free: bool = False, num_step_seqs: int = 1) -> int:
        """Tokens to propose this step (0: not this step), in a step of `num_step_seqs` sequences;
        counts down a pause. `alone_and_free`: the sequence is the step's only one and its
        proposer's guesses cost nothing to make: the maximum, whatever the pause (which keeps
        counting only in shared steps)."""
        if alone_and_free or not self.adaptive:
            return self.max_k
        if self.pause_steps > 0:
            self.pause_steps -= 1
            self.probe_due = self.pause_steps == 0
            return 0
        k = best_k(self.acceptance, self.max_k, self.token_cost(num_step_seqs))
        if self.probe_due:  # one token even where it does not pay: the rate is re-measured
            self.probe_due = False
            return max(k, 1)
        if k == 0:  # this step and `backoff_steps` more without proposing, then a probe
            self.pause_steps = self.backoff_steps
            self.backoff_steps = min(MAX_PAUSE_STEPS, 2 * self.backoff_steps)
        else:
            self.backoff_steps = 1
        return k

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted
        self.num_verified += 1
        if not self.adaptive:
            return
        # Tokens accepted are successes; a proposal ends at its first miss, so at most one failure
        # (a short proposal fully accepted, where the proposer had no more, has none).
        self.accepted = DECAY * self.accepted + num_accepted
        self.rejected = DECAY * self.rejected + (num_accepted < num_proposed)
