"""What a worker's engine step costs, as `pdserve advise` models it: the measured inputs of the
simulator (simulator.py), made by the profiler (profile.py) or read back from a saved JSON.

One step computes up to the engine's token budget of prompt tokens (chunked prefill) and one
token for each running sequence, in one forward pass; its time is modelled as
    fixed_s + per_prompt_token_s x p + per_prompt_token2_s x p^2 + per_sequence_s x running sequences
(p: the step's prompt tokens; the square term is what a long chunk costs beyond linear, its
attention, measured: 2048-token chunks cost 1.5x a 512-token chunk's per token on builtin:small)
with the terms fitted at each thread count a worker of a layout gets. A KV transfer costs
latency_s + bytes / bytes_per_s over the link.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class StepCost:
    fixed_s: float
    per_prompt_token_s: float
    per_sequence_s: float
    per_prompt_token2_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.fixed_s, self.per_prompt_token_s, self.per_sequence_s, self.per_prompt_token2_s) < 0:
            raise ValueError(f"step costs cannot be negative: {self}")

    def step_s(self, prompt_tokens: int, sequences: int) -> float:
        return (self.fixed_s + self.per_prompt_token_s * prompt_tokens
                + self.per_prompt_token2_s * prompt_tokens * prompt_tokens + self.per_sequence_s * sequences)

    def prefill_tokens_per_s(self, budget: int) -> float:
        """A worker's prefill rate on full chunks of `budget` tokens (what its heartbeat reports)."""
        return budget / self.step_s(budget, 0)


@dataclass(frozen=True)
class LinkCost:
    latency_s: float
    bytes_per_s: float

    def transfer_s(self, num_bytes: int) -> float:
        return self.latency_s + (num_bytes / self.bytes_per_s if self.bytes_per_s > 0 else 0.0)


@dataclass(frozen=True)
class Costs:
    model: str
    by_threads: dict[int, StepCost]  # a worker's step at each thread count profiled
    kv_bytes_per_token: int
    link: LinkCost
    cpu: str = ""  # where they were measured (lscpu's model name): costs do not travel between machines
    notes: tuple[str, ...] = field(default_factory=tuple)

    def step(self, threads: int) -> StepCost:
        """The step cost at `threads` (the nearest profiled count at or below it, else the lowest)."""
        below = [t for t in self.by_threads if t <= threads]
        return self.by_threads[max(below) if below else min(self.by_threads)]

    def save(self, path: str | Path) -> None:
        data = asdict(self)
        data["by_threads"] = {str(t): asdict(c) for t, c in self.by_threads.items()}
        Path(path).write_text(json.dumps(data, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Costs:
        try:
            data = json.loads(Path(path).read_text())
            return cls(data["model"], {int(t): StepCost(**c) for t, c in data["by_threads"].items()},
                       int(data["kv_bytes_per_token"]), LinkCost(**data["link"]), data.get("cpu", ""),
                       tuple(data.get("notes", ())))
        except (OSError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: not a pdserve advise costs file ({exc})") from None
