"""Training-test helpers: a few stdlib files as a stand-in corpus and a tiny recipe, so the trainers
and the trained built-ins run end to end in seconds instead of minutes."""

from __future__ import annotations

import shutil
from pathlib import Path

from engine.model.hf_files import ModelShape
from engine.model.train_corpus import split_corpus, stdlib_dir
from engine.model.train_loop import TrainSettings

TINY_TARGET = ModelShape(vocab_size=512, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                         intermediate_size=128, max_position_embeddings=64)
TINY_DRAFT = ModelShape(vocab_size=512, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                        intermediate_size=128, max_position_embeddings=64)
TINY_SETTINGS = TrainSettings(steps=20, batch_size=8, seq_len=64, lr=3e-3, warmup_steps=4, seed=0, eval_windows=16)


def small_stdlib_corpus(dest: Path, train_bytes: int = 150_000) -> Path:
    """Copies some mid-sized stdlib files (about `train_bytes` of train split and two held-out
    files) under `dest`, at their own relative paths so that each keeps its side of the split."""
    split = split_corpus()
    root = stdlib_dir()

    def mid_sized(files: list[str]) -> list[str]:
        return [f for f in files if 5_000 < (root / f).stat().st_size < 30_000]

    chosen, total = [], 0
    for f in mid_sized(split.train):
        if total >= train_bytes:
            break
        chosen.append(f)
        total += (root / f).stat().st_size
    chosen += mid_sized(split.held_out)[:2]
    for f in chosen:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / f, dest / f)
    return dest
