"""What `pdserve bench` sends and when: seeded request sets and arrival times (pure functions).

First step of a bench run (loadgen/runner.py): a WorkloadSpec becomes a list of BenchRequests
(prompt token ids + exact output length), and `arrival_offsets` says when each is sent. The
same spec and seed give the same requests and times on every machine, so two systems can be
measured on identical traffic.

Request shapes: `fixed` (lengths drawn from the input/output distributions), `mixed` (mostly
short prompts, a fraction `long_fraction` of them `long_factor` times longer: the
prefill/decode interference case), `prefix` (`num_prefixes` shared prefixes + unique
suffixes; `num_prefixes=0` is the no-sharing control with the same lengths). `throughput`
and `sweep` send `fixed`-shaped requests; they differ in arrivals (bench.py).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

WORKLOADS = ("fixed", "mixed", "prefix", "throughput", "sweep")
LENGTH_DISTS = ("fixed", "uniform", "exponential")
FIRST_TOKEN_ID = 3  # ids 0, 1, 2 are bos, eos, pad in the built-in tokenizer: never drawn
EXPONENTIAL_CAP = 4.0  # exponential lengths are clipped at 4x the mean (the tail past it is ~2%)


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution. `fixed`: always `mean`; `uniform`: integers in
    [mean * (1 - range_ratio), mean * (1 + range_ratio)]; `exponential`: mean `mean`, clipped
    to [1, EXPONENTIAL_CAP * mean] so a rare draw cannot run past the model's context."""

    mean: int
    kind: str = "fixed"
    range_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_DISTS:
            raise ValueError(f"unknown length distribution {self.kind!r}; choose one of {LENGTH_DISTS}")
        if self.mean < 1:
            raise ValueError(f"a length must be >= 1 token, got {self.mean}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range ratio must be in [0, 1), got {self.range_ratio}")

    @property
    def bounds(self) -> tuple[int, int]:
        if self.kind == "fixed":
            return self.mean, self.mean
        if self.kind == "uniform":
            return max(1, math.ceil(self.mean * (1 - self.range_ratio))), math.floor(self.mean * (1 + self.range_ratio))
        return 1, math.ceil(EXPONENTIAL_CAP * self.mean)

    def sample(self, rng: random.Random) -> int:
        lo, hi = self.bounds
        if self.kind == "fixed":
            return self.mean
        if self.kind == "uniform":
            return rng.randint(lo, hi)
        return min(hi, max(lo, round(rng.expovariate(1.0 / self.mean))))


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    num_prompts: int
    input_len: LengthDist
    output_len: LengthDist
    vocab_size: int = 4096
    seed: int = 0
    long_fraction: float = 0.1  # mixed
    long_factor: int = 8  # mixed: a long prompt is this many times input_len
    num_prefixes: int = 4  # prefix: 0 = the no-sharing control
    suffix_len: int = 16  # prefix: unique tokens after the shared prefix

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"unknown workload {self.name!r}; choose one of {WORKLOADS}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.vocab_size <= FIRST_TOKEN_ID:
            raise ValueError(f"vocab_size must be > {FIRST_TOKEN_ID}, got {self.vocab_size}")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"long_fraction must be in [0, 1], got {self.long_fraction}")


@dataclass(frozen=True)
class BenchRequest:
    prompt: tuple[int, ...]
    output_len: int
    kind: str  # "short"/"long" (mixed), "shared"/"unshared" (prefix), "fixed" otherwise


def make_requests(spec: WorkloadSpec) -> list[BenchRequest]:
    """The spec's requests, reproducible from its seed. Every prompt starts with bos (id 0)."""
    rng = random.Random(spec.seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(FIRST_TOKEN_ID, spec.vocab_size) for _ in range(n))

    def prompt(n: int) -> tuple[int, ...]:
        return (0,) + tokens(max(0, n - 1))

    out = []
    if spec.name == "prefix":
        sharing = spec.num_prefixes > 0
        prefixes = [prompt(spec.input_len.sample(rng)) for _ in range(spec.num_prefixes)]
        for _ in range(spec.num_prompts):
            # The control draws a fresh prefix of the same length distribution per request.
            head = rng.choice(prefixes) if sharing else prompt(spec.input_len.sample(rng))
            out.append(BenchRequest(head + tokens(spec.suffix_len), spec.output_len.sample(rng),
                                    "shared" if sharing else "unshared"))
        return out
    for _ in range(spec.num_prompts):
        n, kind = spec.input_len.sample(rng), "fixed"
        if spec.name == "mixed":
            # Draw the class first from its own coin so the short/long split does not depend
            # on the length distribution's draws.
            long = rng.random() < spec.long_fraction
            n, kind = (n * spec.long_factor, "long") if long else (n, "short")
        out.append(BenchRequest(prompt(n), spec.output_len.sample(rng), kind))
    return out


def spec_for_run(spec: WorkloadSpec, run_index: int) -> WorkloadSpec:
    """The spec of the run_index-th rate of a sweep: same shape, other tokens. Sending the same
    prompts again would hit the prefix cache the previous rate filled and flatter later rates."""
    return replace(spec, seed=spec.seed + 1_000_003 * run_index)


def warmup_spec(spec: WorkloadSpec, num_prompts: int) -> WorkloadSpec:
    """A few requests shaped like the spec's but with other tokens, so warming up does not fill
    the prefix cache with the measured prompts."""
    return replace(spec, num_prompts=num_prompts, seed=spec.seed + 7919)


def arrival_offsets(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds after the start. `rate` = inf: all at 0 (a burst). Otherwise
    inter-arrival gaps are gamma-distributed with mean 1/rate and shape `burstiness`:
    1.0 is a Poisson process, < 1 burstier (clustered arrivals), > 1 more regular."""
    if rate <= 0 or math.isnan(rate):
        raise ValueError(f"rate must be > 0 requests/s (inf for a burst), got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    # Gamma(shape k, scale theta) has mean k * theta: theta = 1 / (rate * k) keeps the rate.
    scale = 1.0 / (rate * burstiness)
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.gammavariate(burstiness, scale)
    return out
