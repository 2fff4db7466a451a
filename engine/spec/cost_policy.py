"""Whether a speculative method pays at the current batch size, measured on this machine
(engine/spec/speculator.py asks before running a method's proposer, and reports every step).

Verifying proposals costs a step the proposer's time and the extra rows; it saves the steps the
accepted tokens replace. Which wins depends on the model, the hardware, the text and the batch
(batch_policy.py's fixed thresholds only bound it), so this measures both sides. For each step
size (sequences in the step, bucketed) it keeps running means of the tokens a step emitted and
the seconds it took, separately for steps where no proposer ran ("off") and, per method, steps
where that method alone proposed ("on"; its proposer's time, the extra rows and the
verification included). A method proposes while its tokens/s is at least the plain step's:
  - first `min_samples` steps on (its cost is unknown), then `min_samples` steps off;
  - then the faster side, except that now and then the other side runs for `probe_steps`
    steps, so a method turned off is re-measured (acceptance and batch change) and the plain
    steps' estimate stays current while a method wins. The first probe comes 2 * min_samples
    decisions after the choice, each further one twice as many decisions later, up to
    `probe_interval` (a choice made on a few noisy steps is checked soon, a settled one rarely);
    a choice that flips starts over. And a probe waits until its expected cost (its steps at the
    other side's measured rate, against the tokens the chosen side would have emitted in that
    time) is at most `probe_budget` of the time the chosen side has run since the last probe: a
    draft model's probe is dear (its first step recomputes the KV of every token the draft
    missed while off), so it comes rarely.
The first step of a run of a method's steps after plain ones is kept out of its running means
and measured apart, as its extra time over them: it carries what the method skipped while off
(a draft's catch-up), a cost of probing, not of proposing, and counted in the means it would
keep a method that pays off (a draft at concurrency 1: every probe looks dear and losing).
Only steps of decodes alone are measured (a prompt chunk's cost would be charged to whichever
side ran it). A step in which a proposer computed prompt tokens of its own KV counts as one: a
draft's first catch-up where its prompt was not prefilled (a decode worker that could not
compute it ahead) is a cost once per request, 12-15 ms for a 256-token prompt on one core of a
2-core CPU, and charged to the method's steps it turned off a draft that pays. Nor is a step
measured whose proposer ran but proposed nothing (prompt lookup without a
match: a few decisions on such steps early in a request would turn a method off before it was
tried); the decisions apply to every step. Greedy output is unchanged by any decision:
the policy only decides whether proposals are made, verification keeps the target's tokens.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

MIN_SAMPLES = 4
PROBE_INTERVAL = 100  # decisions between probes of the side not chosen
PROBE_STEPS = 4  # a probe's length: its first step may carry a draft model's catch-up
PROBE_BUDGET = 0.02  # a probe's expected cost, at most this share of the chosen side's time since the last
SMOOTHING = 0.2  # weight of a new sample in the running means


def size_bucket(num_step_seqs: int) -> int:
    """Step sizes measured apart: 1..8 each, then powers of two (9-16 -> 16, ...)."""
    if num_step_seqs <= 8:
        return num_step_seqs
    return 1 << (num_step_seqs - 1).bit_length()


@dataclass
class StepEstimate:
    """Running means over steps of one kind (exponentially weighted: recent steps count most)."""

    num_samples: int = 0
    tokens: float = 0.0  # emitted per step
    seconds: float = 0.0  # per step

    def add(self, num_tokens: int, seconds: float, smoothing: float) -> None:
        self.num_samples += 1
        weight = 1.0 / self.num_samples if self.num_samples * smoothing < 1.0 else smoothing
        self.tokens += weight * (num_tokens - self.tokens)
        self.seconds += weight * (seconds - self.seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class MethodState:
    """One method at one step size."""

    on: StepEstimate = field(default_factory=StepEstimate)
    winning: bool = True  # the latest comparison's outcome
    decisions_since_probe: int = 0
    probe_gap: int = 0  # decisions from the last probe (or flip) to the next probe (0: not set)
    probe_steps_left: int = 0  # steps still running the side not chosen
    chosen_s_since_probe: float = 0.0  # seconds of measured steps on the chosen side since the last probe
    in_run: bool = False  # the latest measured step at this size ran this method
    first_step_extra_s: float = 0.0  # a run's first step over the mean step (running mean)
    num_first_steps: int = 0  # measured into first_step_extra_s
    num_declined: int = 0  # decisions not to propose (warm-up and probes included)


class CostPolicy:
    def __init__(self, min_samples: int = MIN_SAMPLES, probe_interval: int = PROBE_INTERVAL,
                 probe_steps: int = PROBE_STEPS, smoothing: float = SMOOTHING,
                 probe_budget: float = PROBE_BUDGET) -> None:
        if min_samples < 1 or probe_interval < 1 or probe_steps < 1 or not 0.0 < smoothing <= 1.0 or probe_budget <= 0:
            raise ValueError("min_samples, probe_interval and probe_steps must be >= 1, smoothing in (0, 1], "
                             "probe_budget > 0")
        self.min_samples = min_samples
        self.probe_interval = probe_interval
        self.probe_steps = probe_steps
        self.smoothing = smoothing
        self.probe_budget = probe_budget
        self.off: dict[int, StepEstimate] = {}  # by size bucket: steps where no proposer ran
        self.methods: dict[tuple[str, int], MethodState] = {}  # by (method, size bucket)

    def should_propose(self, method: str, num_step_seqs: int) -> bool:
        """Whether `method`'s proposer runs in a step of `num_step_seqs` sequences (one call per
        method per step: the probes count these calls)."""
        key = size_bucket(num_step_seqs)
        state = self.methods.setdefault((method, key), MethodState())
        off = self.off.setdefault(key, StepEstimate())
        if state.on.num_samples < self.min_samples:
            decision = True
        elif off.num_samples < self.min_samples:
            decision = False
        elif state.probe_steps_left > 0:
            state.probe_steps_left -= 1
            decision = not state.winning
        else:
            winning = state.on.tokens_per_s >= off.tokens_per_s
            if winning != state.winning or not state.probe_gap:  # a new choice: check it soon
                state.probe_gap = min(self.probe_interval, 2 * self.min_samples)
                state.decisions_since_probe, state.chosen_s_since_probe = 0, 0.0
            state.winning = winning
            state.decisions_since_probe += 1
            decision = winning
            if (state.decisions_since_probe >= state.probe_gap
                    and state.chosen_s_since_probe * self.probe_budget >= self.probe_cost_s(state, off)):
                state.decisions_since_probe, state.chosen_s_since_probe = 0, 0.0
                state.probe_gap = min(self.probe_interval, 2 * state.probe_gap)
                state.probe_steps_left = self.probe_steps - 1
                decision = not winning
        state.num_declined += not decision
        return decision

    def favours(self, method: str, num_step_seqs: int) -> bool:
        """Whether `method` is the side chosen at this step size as last measured (True until it
        is measured), without counting a decision: for work done ahead of proposing (a draft's
        prompt KV), which only pays where the method will propose."""
        state = self.methods.get((method, size_bucket(num_step_seqs)))
        return state is None or state.on.num_samples < self.min_samples or state.winning

    def probe_cost_s(self, state: MethodState, off: StepEstimate) -> float:
        """Seconds a probe is expected to lose: its steps at the other side's mean step time,
        less the time the chosen side takes for as many tokens."""
        chosen, other = (state.on, off) if state.winning else (off, state.on)
        if chosen.tokens_per_s <= 0:
            return 0.0
        restart = 0.0 if state.winning else state.first_step_extra_s  # a probe of the method starts a run
        return restart + self.probe_steps * max(0.0, other.seconds - other.tokens / chosen.tokens_per_s)

    def record(self, methods: Collection[str], num_step_seqs: int, num_tokens: int, seconds: float) -> None:
        """A measured step of decodes: the methods whose proposers ran in it (none: a plain
        step), its sequences, the tokens it emitted and its wall time. A step that ran several
        methods is not attributed to any."""
        key = size_bucket(num_step_seqs)
        if not methods:
            self.off.setdefault(key, StepEstimate()).add(num_tokens, seconds, self.smoothing)
            for (_, k), state in self.methods.items():
                if k == key:
                    state.in_run = False
                    if not state.winning and not state.probe_steps_left:  # the chosen side of a losing method
                        state.chosen_s_since_probe += seconds
        elif len(methods) == 1:
            (method,) = methods
            state = self.methods.setdefault((method, key), MethodState())
            if not state.in_run:  # a run's first step: measured apart
                state.in_run = True
                if state.on.num_samples:
                    state.num_first_steps += 1
                    weight = max(self.smoothing, 1.0 / state.num_first_steps)  # a plain mean at first
                    extra = max(0.0, seconds - state.on.seconds)
                    state.first_step_extra_s += weight * (extra - state.first_step_extra_s)
                return
            state.on.add(num_tokens, seconds, self.smoothing)
            if state.winning and not state.probe_steps_left:
                state.chosen_s_since_probe += seconds

    def describe(self) -> list[str]:
        """One line per method and step size: both sides' tokens/s and the latest choice."""
        lines = []
        for (method, key), state in sorted(self.methods.items()):
            off = self.off.get(key, StepEstimate())
            lines.append(f"{method} at {key} seqs: on {state.on.tokens_per_s:.1f} tok/s ({state.on.num_samples} steps), "
                         f"off {off.tokens_per_s:.1f} tok/s ({off.num_samples} steps), "
                         f"{'proposing' if state.winning else 'off'}, declined {state.num_declined}")
        return lines
