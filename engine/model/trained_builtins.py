"""The recipes of the trained built-ins, `builtin:code-small`, `builtin:code-draft` and
`builtin:code-medusa`, and their cache names.

engine/model/builtin.py resolves `builtin:code-small` / `builtin:code-draft` to a cache
directory and, on first use, calls `build_trained` here: code-small is trained on this Python's
standard library (engine/model/train.py, ~12 minutes on 2 cores without AMX), code-draft is
distilled from it (engine/model/distill.py), code-medusa is Medusa heads fitted to it
(engine/model/train_medusa.py; heads, not a model: speculative.medusa_heads names them).
`pdserve model train` / `distill` / `train-medusa` run the same recipes, with the command line's
overrides (cluster/cmd_model.py).

PDSERVE_TRAIN_STEPS=N (environment) replaces both recipes' step counts, for a quick, poor model
(a smoke test, CI); such a build is cached under its own name (`...-stepsN`), never as the real one.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from engine.model.builtin import ensure_builtin
from engine.model.hf_files import ModelShape
from engine.model.own_text import OwnText
from engine.model.train_loop import Compute, TrainSettings

FORMAT_VERSION = "t2"  # bump when a recipe or the training code changes the bytes, so stale caches are not reused
STEPS_ENV = "PDSERVE_TRAIN_STEPS"
TARGET = "code-small"
DRAFT = "code-draft"
MEDUSA = "code-medusa"


@dataclass(frozen=True)
class Recipe:
    shape: ModelShape
    settings: TrainSettings
    own_text: OwnText | None = None  # a draft's: text its target wrote, in every batch (engine/model/own_text.py)


# Sized to train within 15 minutes on this project's 2-core CPUs, with or without AMX (bf16, compiled): see docs/engine.md.
RECIPES = {
    # 12.6M parameters (vocab 8192, hidden 384, 6 layers, 6 heads of 64, 2 KV heads), 512-token context.
    # 450 steps of 8 x 512 tokens: 12.2 minutes on 2 Zen 4 cores (bf16 at half rate, no AMX), where
    # 500 of 8 x 1024 (the t1 recipe) took 34.7; see docs/engine.md.
    TARGET: Recipe(ModelShape(8192, 384, 6, 6, 2, 1024, 512),
                   TrainSettings(steps=450, batch_size=8, seq_len=512, lr=2e-3, warmup_steps=30, seed=1,
                                 eval_windows=64)),
    # The target's embedding and first 2 layers, then fitted to the target's distributions.
    DRAFT: Recipe(ModelShape(8192, 384, 2, 6, 2, 1024, 512),
                  TrainSettings(steps=400, batch_size=8, seq_len=512, lr=1e-3, warmup_steps=20, seed=2,
                                eval_windows=64),
                  OwnText(num_windows=256, per_batch=2, prompt_len=256)),
}


@dataclass(frozen=True)
class MedusaRecipe:
    num_heads: int
    num_layers: int  # residual blocks per head
    settings: TrainSettings
    tied_projection: bool = False  # only the blocks learn; each projection stays the target's


# Heads for code-small: 3 heads of one block (Medusa's default depth), on shorter windows than the
# models' (a head sees every position's hidden state: 8 x 512 positions a step is plenty).
MEDUSA_RECIPE = MedusaRecipe(3, 1, TrainSettings(steps=300, batch_size=8, seq_len=512, lr=1e-3, warmup_steps=20,
                                                 seed=3, eval_windows=32))


def steps_override() -> int | None:
    text = os.environ.get(STEPS_ENV)
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{STEPS_ENV} must be a positive number of steps, got {text!r}")
    return int(text)


def recipe(name: str) -> Recipe:
    """The recipe of `name`, with PDSERVE_TRAIN_STEPS applied."""
    base = RECIPES[name]
    steps = steps_override()
    return base if steps is None else replace(base, settings=replace(base.settings, steps=steps))


def medusa_recipe() -> MedusaRecipe:
    """code-medusa's recipe, with PDSERVE_TRAIN_STEPS applied."""
    steps = steps_override()
    return MEDUSA_RECIPE if steps is None else replace(MEDUSA_RECIPE, settings=replace(MEDUSA_RECIPE.settings,
                                                                                       steps=steps))


def trained_cache_entry_name(name: str) -> str:
    steps = steps_override()
    return f"builtin-{name}-{FORMAT_VERSION}" + (f"-steps{steps}" if steps is not None else "")


def build_trained(name: str, out: Path, cache_dir: str | Path | None = None) -> Path:
    """Trains (code-small) or distils (code-draft, from code-small in `cache_dir`) into `out`, or
    fits code-medusa's heads to code-small."""
    if name == MEDUSA:
        from engine.model.train_medusa import train_medusa_checkpoint

        m = medusa_recipe()
        report = train_medusa_checkpoint(ensure_builtin(TARGET, cache_dir), out, MEDUSA, "builtin:" + TARGET,
                                         m.num_heads, m.num_layers, m.settings, Compute.default(m.settings.steps),
                                         tied_projection=m.tied_projection)
        print(report.summary(), file=sys.stderr)
        return out
    r = recipe(name)
    compute = Compute.default(r.settings.steps)
    if name == TARGET:
        from engine.model.train import train_checkpoint

        summary = train_checkpoint(out, TARGET, r.shape, r.settings, compute).summary()
    else:
        from engine.model.distill import distill_checkpoint

        target_dir = ensure_builtin(TARGET, cache_dir)
        summary = distill_checkpoint(target_dir, out, DRAFT, "builtin:" + TARGET, r.shape, r.settings,
                                     compute, own=r.own_text).summary()
    print(summary, file=sys.stderr)
    return out
