"""`pdserve model build`, `model train`, `model distill` and `model train-medusa`: write a checkpoint.

`build` writes a built-in by name (the trained ones through the cache, trained there on first
use); `train` and `distill` run the recipes of engine/model/trained_builtins.py with the command
line's overrides (steps, seed, threads, compile) into a directory of the user's choice, in
Hugging Face format; `train-medusa` fits Medusa heads to a target and writes them in Medusa's
published layout.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

_BUILT_FILES = ("config.json", "generation_config.json", "model.safetensors", "pdserve_builtin.json",
                "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json")


def _check_out_dir(out: str, force: bool) -> Path:
    """Checks, before any work (training takes minutes), that `out` may be written; it is made
    only when there is something to write into it."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise SystemExit(f"pdserve: {out} exists and is not a directory")
    if os.path.exists(out) and os.listdir(out) and not force:
        raise SystemExit(f"pdserve: {out} exists and is not empty (use --force to overwrite)")
    return Path(out)


def model_build(args: argparse.Namespace) -> int:
    from engine.model.builtin import TRAINED_NAMES, build_builtin, builtin_names, ensure_builtin, parse_builtin

    name = parse_builtin(args.name)
    if name is None:
        raise SystemExit(f"pdserve: {args.name!r} is not a built-in model name ({', '.join(builtin_names())})")
    out = _check_out_dir(args.out, args.force)
    if name in TRAINED_NAMES:  # minutes of training: once, into the cache, then copied
        cached = ensure_builtin(name)
        out.mkdir(parents=True, exist_ok=True)
        for file in _BUILT_FILES:
            shutil.copyfile(cached / file, out / file)
    else:
        build_builtin(name, out)
    print(f"wrote {args.name} to {out}")
    return 0


def _compute(args: argparse.Namespace, steps: int):
    from engine.model.train_loop import Compute

    compile_choice = {"auto": None, "on": True, "off": False}[args.compile]
    return Compute.default(steps, threads=args.threads, compile=compile_choice)


def _settings(args: argparse.Namespace, name: str):
    from engine.model.trained_builtins import RECIPES

    base = RECIPES[name]
    changes = {k: v for k, v in (("steps", args.steps), ("seed", args.seed)) if v is not None}
    return base.shape, replace(base.settings, **changes)


def model_train(args: argparse.Namespace) -> int:
    from engine.model.train import train_checkpoint
    from engine.model.trained_builtins import TARGET

    shape, settings = _settings(args, TARGET)
    out = _check_out_dir(args.out, args.force)
    report = train_checkpoint(out, TARGET, shape, settings, _compute(args, settings.steps), progress=True)
    print(report.summary())
    print(f"wrote {out}")
    return 0


def model_distill(args: argparse.Namespace) -> int:
    from engine.model.distill import distill_checkpoint
    from engine.model.loader import resolve_model_path
    from engine.model.trained_builtins import DRAFT, recipe

    shape, settings = _settings(args, DRAFT)
    out = _check_out_dir(args.out, args.force)
    target_dir = resolve_model_path(args.target)  # builtin:code-small: trained first if not cached
    report = distill_checkpoint(target_dir, out, DRAFT, args.target, shape, settings, _compute(args, settings.steps),
                                progress=True, own=recipe(DRAFT).own_text)
    print(report.summary())
    print(f"wrote {out}")
    return 0


def model_train_medusa(args: argparse.Namespace) -> int:
    from engine.model.loader import resolve_model_path
    from engine.model.train_medusa import train_medusa_checkpoint
    from engine.model.trained_builtins import MEDUSA, medusa_recipe

    base = medusa_recipe()
    changes = {k: v for k, v in (("steps", args.steps), ("seed", args.seed)) if v is not None}
    settings = replace(base.settings, **changes)
    out = _check_out_dir(args.out, args.force)
    target_dir = resolve_model_path(args.target)  # builtin:code-small: trained first if not cached
    report = train_medusa_checkpoint(target_dir, out, MEDUSA, args.target, args.num_heads or base.num_heads,
                                     base.num_layers if args.num_layers is None else args.num_layers, settings,
                                     _compute(args, settings.steps), progress=True, soft_labels=args.soft_labels,
                                     tied_projection=args.tie_projection or base.tied_projection)
    print(report.summary())
    print(f"wrote {out}")
    return 0


# The recipes' numbers as the help shows them: the parser is built for every `pdserve` command and
# must not import torch (engine/), so they are written here; tests/unit/test_train_cli.py checks them.
TARGET_HELP = "12.6M parameters: hidden 384, 6 layers, vocabulary 8192, context 512"
TARGET_STEPS, TARGET_SEED = 450, 1
DRAFT_HELP = "6.3M parameters: hidden 384, 2 layers"
DRAFT_STEPS, DRAFT_SEED = 400, 2
DRAFT_OWN_TEXT_HELP = "2 windows of each batch (256 windows, each 256 tokens of text then 257 of its own)"
BATCH_HELP = "8 windows of 512 tokens"
MEDUSA_STEPS, MEDUSA_SEED, MEDUSA_HEADS, MEDUSA_LAYERS = 300, 3, 3, 1
MEDUSA_BATCH_HELP = "8 windows of 512 tokens"


def add_model_commands(sub: argparse._SubParsersAction) -> None:
    """The `model` command group of cluster/cli.py."""
    model = sub.add_parser("model", help="write checkpoints: build a built-in, train a target, distil a draft, "
                           "fit Medusa heads",
                           description="Write checkpoints in Hugging Face format (config.json, model.safetensors, "
                           "tokenizer.json), loadable by pdserve and by transformers.")
    model_sub = model.add_subparsers(dest="model_command", required=True)

    build = model_sub.add_parser(
        "build", help="write a built-in model to a directory",
        description="Write a built-in model to a directory. builtin:tiny and builtin:small are random and made in "
        "seconds; builtin:code-small and builtin:code-draft are trained (about 12 and 8 minutes on 2 cores with AMX) "
        "into the cache (~/.cache/pdserve or $PDSERVE_CACHE) on first use and copied from there. "
        "PDSERVE_TRAIN_STEPS=N trains them for N steps instead (a quick, poor model cached under its own name).")
    build.add_argument("name", help="builtin:tiny, builtin:small, builtin:code-small or builtin:code-draft")
    build.add_argument("--out", required=True, help="directory to write (config.json, model.safetensors, tokenizer.json)")
    build.add_argument("--force", action="store_true", help="write into a non-empty directory")
    build.set_defaults(func=model_build)

    train = model_sub.add_parser(
        "train", help="train a small Llama on this Python's standard library (builtin:code-small's recipe)",
        description=f"Train builtin:code-small's model ({TARGET_HELP}) from scratch on the .py files of "
        "this Python's standard library: a byte-level BPE tokenizer fitted on the train split, then next-token "
        "training with a progress bar; prints the loss and perplexity on held-out stdlib files (1 in 20, chosen "
        "by a hash of the path, never trained on). Deterministic: the same options, CPU and thread count give "
        "the same bytes. The defaults reproduce builtin:code-small.")
    _training_args(train, TARGET_STEPS, TARGET_SEED)
    train.set_defaults(func=model_train)

    distill = model_sub.add_parser(
        "distill", help="distil a small draft model from a target (builtin:code-draft's recipe)",
        description=f"Distil builtin:code-draft's model ({DRAFT_HELP}) from a target with the same tokenizer: "
        "the draft starts from the target tensors it shares by name and shape (embedding, first layers, final "
        "norm) and learns the target's next-token distributions (KL at temperature 1) on the same text and, in "
        f"{DRAFT_OWN_TEXT_HELP}, on text the target wrote itself: it first continues windows of the text greedily, "
        "with a progress bar, since speculative decoding accepts what the target generates. Prints the held-out "
        "loss, the KL and the top-1 agreement with the target. The defaults reproduce builtin:code-draft.")
    distill.add_argument("--target", default="builtin:code-small",
                         help="the target: a built-in name or a checkpoint directory with builtin:code-small's "
                         "tokenizer (default builtin:code-small, trained first if not cached)")
    _training_args(distill, DRAFT_STEPS, DRAFT_SEED)
    distill.set_defaults(func=model_distill)

    medusa = model_sub.add_parser(
        "train-medusa", help="fit Medusa heads to a target (builtin:code-medusa's recipe)",
        description="Fit Medusa heads (Medusa-1) to a frozen target on the same stdlib text: head i reads the "
        "target's final hidden state at each position and learns the token i + 2 positions ahead; each starts as "
        "the identity block and the target's own vocabulary projection. Prints the held-out loss before and "
        "after, and each head's top-1 accuracy, which Medusa speculation's acceptance follows. Writes Medusa's "
        "published layout (medusa_lm_head.safetensors, config.json with medusa_num_heads, medusa_num_layers, "
        "hidden_size, vocab_size, base_model_name_or_path) for speculative.medusa_heads. The defaults reproduce "
        "builtin:code-medusa.")
    medusa.add_argument("--target", default="builtin:code-small",
                        help="the target: a built-in name or a Llama-family checkpoint directory with tokenizer.json "
                        "(default builtin:code-small, trained first if not cached)")
    medusa.add_argument("--num-heads", type=_count(1), default=None,
                        help=f"heads, i.e. tokens proposed per step at most (default {MEDUSA_HEADS})")
    medusa.add_argument("--num-layers", type=_count(0), default=None,
                        help=f"residual blocks per head (default {MEDUSA_LAYERS})")
    medusa.add_argument("--tie-projection", action="store_true",
                        help="train only the residual blocks, each head's vocabulary projection staying the "
                        "target's own: pdserve then multiplies all heads by the target's projection in one "
                        "product, reading it once (a head's projection is as big as the target's)")
    medusa.add_argument("--soft-labels", action="store_true",
                        help="learn the target's own distribution for each future token (KL, Medusa's "
                        "self-distillation) instead of the text's token")
    _training_args(medusa, MEDUSA_STEPS, MEDUSA_SEED, MEDUSA_BATCH_HELP)
    medusa.set_defaults(func=model_train_medusa)


def _count(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= `minimum`, or argparse's usage error naming the option."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _training_args(parser: argparse.ArgumentParser, steps: int, seed: int, batch_help: str = BATCH_HELP) -> None:
    parser.add_argument("--out", required=True, help="directory to write the checkpoint into")
    parser.add_argument("--force", action="store_true", help="write into a non-empty directory")
    parser.add_argument("--steps", type=_count(1), help=f"optimiser steps of {batch_help} (default {steps})")
    parser.add_argument("--seed", type=_count(0),
                        help=f"seeds the initial weights and the order of the text (default {seed})")
    parser.add_argument("--threads", type=_count(1),
                        help="torch threads (default: the cores this process may use); the bytes depend on it")
    parser.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                        help="torch.compile the training step: about 2x faster after 20-40 s of compiling "
                        "(auto: from 50 steps on; default auto); the bytes depend on it")
