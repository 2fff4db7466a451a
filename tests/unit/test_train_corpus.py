"""The training text: a fixed, disjoint train/held-out split of the stdlib, and seeded window batches."""

from __future__ import annotations

import pytest
import torch

from engine.model import train_corpus
from engine.model.train_corpus import (
    EXCLUDED_DIRS,
    WindowSampler,
    held_out_windows,
    is_held_out,
    num_windows,
    split_corpus,
)


def test_the_split_is_disjoint_fixed_and_about_one_file_in_twenty():
    split = split_corpus()
    assert split.train and split.held_out
    assert not set(split.train) & set(split.held_out)
    assert split_corpus() == split
    share = len(split.held_out) / (len(split.train) + len(split.held_out))
    assert 0.02 < share < 0.1, share
    # A file's side depends on its path only.
    assert all(is_held_out(f) for f in split.held_out) and not any(is_held_out(f) for f in split.train)
    assert "json/decoder.py" in split.train + split.held_out  # packages count, not just top-level modules


def test_tests_generated_tables_and_site_packages_are_left_out():
    files = train_corpus.corpus_files()
    assert files == sorted(files)
    for f in files:
        assert not EXCLUDED_DIRS.intersection(f.split("/")[:-1]), f
    assert not any(f.startswith(("encodings/", "test/", "site-packages/")) for f in files)


def test_the_tokenizer_sees_no_held_out_line(tmp_path):
    split = split_corpus()
    held = split.read(split.held_out[0])
    train_text = "".join(split.train_lines())
    assert len(train_text) == sum(len(split.read(f)) for f in split.train)
    # The held-out file's own content is not what the tokenizer is fitted on (beyond chance lines).
    assert held not in train_text


def stream(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int32)


def test_windows_share_one_token_and_cover_every_pair():
    s = stream(101)
    assert num_windows(s, 10) == 10
    sampler = WindowSampler(s, 10, seed=0)
    batch = sampler.next_batch(10)  # one epoch: each window once
    assert batch.shape == (10, 11) and batch.dtype == torch.int64
    starts = sorted(batch[:, 0].tolist())
    assert starts == list(range(0, 100, 10))
    for row in batch:
        assert torch.equal(row, torch.arange(row[0], row[0] + 11))
    assert sampler.epochs_started == 1
    sampler.next_batch(1)
    assert sampler.epochs_started == 2


def test_the_same_seed_gives_the_same_batches_and_another_seed_others():
    s = stream(10_001)
    a, b, c = WindowSampler(s, 16, seed=7), WindowSampler(s, 16, seed=7), WindowSampler(s, 16, seed=8)
    for _ in range(3):
        batch = a.next_batch(4)
        assert torch.equal(batch, b.next_batch(4))
    assert not torch.equal(WindowSampler(s, 16, seed=7).next_batch(8), c.next_batch(8))


def test_held_out_windows_are_evenly_spaced_and_fixed():
    s = stream(1001)
    w = held_out_windows(s, 10, 4)
    assert w[:, 0].tolist() == [0, 250, 500, 750]
    assert torch.equal(w, held_out_windows(s, 10, 4))
    assert held_out_windows(s, 10, 1000).shape == (100, 11)
    with pytest.raises(ValueError, match="fewer than one window"):
        held_out_windows(stream(10), 10, 4)
    with pytest.raises(ValueError, match="fewer than one window"):
        WindowSampler(stream(5), 10, seed=0)
