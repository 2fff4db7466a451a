"""The text the trained built-ins learn from: this Python's standard library, split and tokenized.

First stop of training (engine/model/trained_builtins.py, `pdserve model train` / `distill`):
stdlib .py files -> a train / held-out split fixed by a hash of each file's path (the same on
every machine with this Python) -> one token stream per split (`<s> file </s>` after one
another) -> fixed-length windows. Training draws windows in an order shuffled by a seeded
generator (engine/model/train.py, engine/model/distill.py); the held-out evaluation reads
evenly spaced windows of the held-out stream, always the same ones.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from engine.model.hf_files import EOS_ID

# Tests, third-party packages and generated tables (codecs, pydoc's topic dump) are not the code
# a code model should learn, and they would crowd out what is.
EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data"})
HELD_OUT_ONE_IN = 20  # about 5% of the files are never trained on


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[str]:
    """The corpus: every .py file under this Python's stdlib outside EXCLUDED_DIRS, as paths
    relative to it, in name order."""
    base = root or stdlib_dir()
    files = []
    for path in base.rglob("*.py"):
        rel = path.relative_to(base)
        if path.is_file() and not EXCLUDED_DIRS.intersection(rel.parts[:-1]):
            files.append(rel.as_posix())
    return sorted(files)


def is_held_out(rel_path: str) -> bool:
    """A file's split depends on its path alone, so adding or removing a file moves no other."""
    digest = hashlib.sha256(rel_path.encode()).digest()
    return int.from_bytes(digest[:8], "big") % HELD_OUT_ONE_IN == 0


@dataclass(frozen=True)
class CorpusSplit:
    root: Path
    train: list[str]
    held_out: list[str]

    def read(self, rel_path: str) -> str:
        return (self.root / rel_path).read_text(encoding="utf-8", errors="replace")

    def train_lines(self) -> Iterator[str]:
        """The train split line by line: what the tokenizer is fitted on (never the held-out files)."""
        for rel in self.train:
            yield from self.read(rel).splitlines(keepends=True)


def split_corpus(root: Path | None = None) -> CorpusSplit:
    base = root or stdlib_dir()
    files = corpus_files(base)
    return CorpusSplit(base, [f for f in files if not is_held_out(f)], [f for f in files if is_held_out(f)])


def token_stream(tokenizer_file: Path, texts: list[str]) -> torch.Tensor:
    """`<s> text </s>` for each text, concatenated: [num_tokens] int32."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=True):  # the post-processor adds <s>
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.int32)


def num_windows(stream: torch.Tensor, seq_len: int) -> int:
    # Window i is stream[i*seq_len : i*seq_len + seq_len + 1]: inputs and next-token targets;
    # neighbours share one token, so every next-token pair of the stream is in exactly one window.
    return (stream.numel() - 1) // seq_len


def window(stream: torch.Tensor, seq_len: int, index: int) -> torch.Tensor:
    start = index * seq_len
    return stream[start : start + seq_len + 1]


def held_out_windows(stream: torch.Tensor, seq_len: int, max_windows: int) -> torch.Tensor:
    """Up to `max_windows` windows evenly spaced over the held-out stream: [n, seq_len + 1] int64."""
    total = num_windows(stream, seq_len)
    if total < 1:
        raise ValueError(f"the held-out text has {stream.numel()} tokens, fewer than one window of {seq_len + 1}")
    n = min(total, max_windows)
    picks = [i * total // n for i in range(n)]
    return torch.stack([window(stream, seq_len, i) for i in picks]).long()


class BatchSource(Protocol):
    """What the training loop draws its batches from (WindowSampler, own_text.MixedSampler)."""

    def next_batch(self, batch_size: int) -> torch.Tensor: ...


class WindowSampler:
    """Training batches: every window once per epoch, in an order drawn from `seed`; the same
    seed gives the same batches on any machine."""

    def __init__(self, stream: torch.Tensor, seq_len: int, seed: int) -> None:
        self.stream, self.seq_len = stream, seq_len
        self.num_windows = num_windows(stream, seq_len)
        if self.num_windows < 1:
            raise ValueError(f"the training text has {stream.numel()} tokens, fewer than one window of {seq_len + 1}")
        self._gen = torch.Generator().manual_seed(seed)
        self._order: list[int] = []
        self.epochs_started = 0

    def next_batch(self, batch_size: int) -> torch.Tensor:
        """[batch_size, seq_len + 1] int64."""
        rows = []
        for _ in range(batch_size):
            if not self._order:
                self._order = torch.randperm(self.num_windows, generator=self._gen).tolist()
                self.epochs_started += 1
            rows.append(window(self.stream, self.seq_len, self._order.pop()))
        return torch.stack(rows).long()
