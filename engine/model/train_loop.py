"""The optimisation loop both trainers share: settings, learning-rate schedule, AdamW, progress bar.

engine/model/train.py (next-token loss against the text) and engine/model/distill.py (KL to the
target's distributions) each hand `run_steps` a loss over one batch of windows from
engine/model/train_corpus.py; the loop owns everything else. Deterministic: batches come from a
seeded sampler, weights from a seeded init, and on a CPU the same kernels on the same number of
threads add in the same order, so the same settings give the same weights, bit for bit.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from tqdm import tqdm

from engine.model.compute_dtype import cpu_has_native_bf16
from engine.model.train_corpus import BatchSource

log = logging.getLogger(__name__)

# Compiling the step costs about 20-40 s on 2 cores and then runs it about 2x faster (measured
# on this project's 2-core machine, a 12.6M-parameter model, bf16): worth it from a few dozen steps.
COMPILE_MIN_STEPS = 50


@dataclass(frozen=True)
class TrainSettings:
    steps: int
    batch_size: int  # windows per step
    seq_len: int  # tokens per window (the model sees seq_len inputs, predicts seq_len targets)
    lr: float  # peak learning rate, after warm-up
    warmup_steps: int
    seed: int  # weights and batch order
    eval_windows: int  # held-out windows evaluated at the end
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    weight_decay: float = 0.1
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.seq_len < 2 or self.eval_windows < 1:
            raise ValueError(f"steps, batch size, eval windows must be >= 1 and seq_len >= 2: {self}")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


@dataclass(frozen=True)
class Compute:
    """How the arithmetic runs; it decides the exact bytes of the result along with the settings."""

    threads: int
    bf16: bool  # autocast matmuls to bfloat16: where the CPU has native bf16 (AMX/AVX512-BF16)
    compile: bool  # torch.compile the step

    @classmethod
    def default(cls, steps: int, threads: int | None = None, compile: bool | None = None) -> Compute:
        return cls(threads=threads or default_threads(), bf16=cpu_has_native_bf16(),
                   compile=steps >= COMPILE_MIN_STEPS if compile is None else compile)

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16)


def default_threads() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0))


@contextlib.contextmanager
def using_threads(threads: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """Torch's deterministic mode while training. Inductor's CPU code adds scattered gradients
    (the embedding's, the loss's) with atomic adds from parallel threads, in an order that varies
    from run to run (two compiled runs differed in their last bits); in deterministic mode it
    calls the ordered eager kernels instead. Eager CPU kernels are ordered either way. The mode's
    NaN-filling of new tensors (a check for reads of uninitialised memory) is left off: it is a
    write over every output, paid on each step, and this code reads nothing uninitialised."""
    # The attribute is a module property that the type stubs do not show.
    import torch.utils.deterministic as mode

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              mode.fill_uninitialized_memory)  # type: ignore[attr-defined]
    torch.use_deterministic_algorithms(True)
    mode.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        mode.fill_uninitialized_memory = before[2]  # type: ignore[attr-defined]


def learning_rate(step: int, s: TrainSettings) -> float:
    """Linear warm-up to s.lr over s.warmup_steps, then cosine decay to s.lr * s.min_lr_ratio at the last step."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    decay_steps = max(1, s.steps - 1 - s.warmup_steps)
    progress = min(1.0, (step - s.warmup_steps) / decay_steps)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, s: TrainSettings) -> torch.optim.Optimizer:
    """AdamW; weight decay on the matrices only (never on norms)."""
    params = [p for _, p in sorted(model.named_parameters()) if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=s.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)


def compiled_or_eager(fn: Callable, compile: bool) -> tuple[Callable, Callable[[], bool]]:
    """`fn` under torch.compile when asked; if compiling fails on the first call (no C++
    compiler, say), a warning and the eager `fn` from then on. Returns the callable and a probe
    saying whether the compiled version is what ran."""
    if not compile:
        return fn, lambda: False
    compiled = torch.compile(fn, dynamic=False)
    state = {"compiled": True, "called": False}

    def call(*args):
        if state["called"]:
            return (compiled if state["compiled"] else fn)(*args)
        state["called"] = True
        try:
            return compiled(*args)
        except Exception as exc:  # noqa: BLE001  (any compiler failure: run the same maths eagerly)
            log.warning("torch.compile failed (%s: %s); training eagerly", type(exc).__name__, exc)
            state["compiled"] = False
            return fn(*args)

    return call, lambda: state["compiled"]


@dataclass(frozen=True)
class LoopStats:
    steps: int
    tokens: int
    seconds: float  # the whole loop, the first (compiling) step included
    steady_tokens_per_s: float  # after the first step
    last_loss: float  # mean over the last 10 steps
    compiled: bool


def describe_run(stats: LoopStats, compute: Compute) -> str:
    """How a loop ran, as the trainers' summaries print it: steps, tokens, time, speed, compute."""
    return (f"{stats.steps} steps, {stats.tokens / 1e6:.2f}M tokens in {stats.seconds / 60:.1f} min "
            f"({stats.steady_tokens_per_s:,.0f} tok/s after the first step; {compute.threads} threads, "
            f"{'bf16' if compute.bf16 else 'fp32'}, {'compiled' if compute.compile else 'eager'})")


def run_steps(model: torch.nn.Module, batch_loss: Callable[[torch.Tensor], torch.Tensor], sampler: BatchSource,
              s: TrainSettings, compute: Compute, desc: str, progress: bool | None = None) -> LoopStats:
    """Runs s.steps optimiser steps of `batch_loss` over batches from `sampler`, with a progress
    bar (`progress` None: only on a terminal). Raises RuntimeError if the loss stops being finite."""
    opt = make_optimizer(model, s)
    step_loss, ran_compiled = compiled_or_eager(batch_loss, compute.compile)
    model.train()
    recent: list[float] = []
    start = time.perf_counter()
    first_step_end = start
    bar = tqdm(total=s.steps, desc=desc, unit="step", disable=None if progress is None else not progress,
               mininterval=1.0)
    with using_threads(compute.threads), deterministic_algorithms(), bar:
        for step in range(s.steps):
            for group in opt.param_groups:
                group["lr"] = learning_rate(step, s)
            loss = step_loss(sampler.next_batch(s.batch_size))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            value = loss.item()
            if not math.isfinite(value):
                raise RuntimeError(f"{desc}: the loss is {value} at step {step}; training diverged")
            recent = (recent + [value])[-10:]
            now = time.perf_counter()
            if step == 0:
                first_step_end = now
                bar.set_postfix_str(f"loss {value:.3f}")
            else:
                bar.set_postfix_str(f"loss {value:.3f}, {step * s.tokens_per_step / (now - first_step_end):,.0f} tok/s")
            bar.update()
    seconds = time.perf_counter() - start
    after_first = time.perf_counter() - first_step_end
    steady = (s.steps - 1) * s.tokens_per_step / after_first if s.steps > 1 and after_first > 0 else 0.0
    return LoopStats(s.steps, s.steps * s.tokens_per_step, seconds, steady, sum(recent) / len(recent), ran_compiled())


def batched(windows: torch.Tensor, batch_size: int) -> Iterator[torch.Tensor]:
    for i in range(0, windows.shape[0], batch_size):
        yield windows[i : i + batch_size]
