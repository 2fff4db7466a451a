"""engine/model/own_text.py: the target's greedy continuations as distillation windows, mixed into
the corpus's batches."""

from __future__ import annotations

import pytest
import torch

from engine.model.own_text import MixedSampler, OwnText, own_text_windows
from engine.model.train_corpus import WindowSampler, num_windows, window
from engine.model.train_loop import Compute
from engine.model.train_model import build_model
from tests.train_helpers import TINY_TARGET

EAGER_FP32 = Compute(threads=2, bf16=False, compile=False)
SEQ_LEN = 32


@pytest.fixture(scope="module")
def stream() -> torch.Tensor:
    return torch.randint(0, TINY_TARGET.vocab_size, (4000,), generator=torch.Generator().manual_seed(0),
                         dtype=torch.int32)


def test_each_window_is_a_corpus_prompt_the_target_continued_greedily(stream):
    target = build_model(TINY_TARGET, seed=0).eval()
    own = OwnText(num_windows=5, per_batch=1, prompt_len=10)
    written = own_text_windows(target, stream, SEQ_LEN, own, seed=3, compute=EAGER_FP32, progress=False)
    assert written.shape == (5, SEQ_LEN + 1) and written.dtype == torch.int64
    picks = torch.randint(num_windows(stream, SEQ_LEN), (5,), generator=torch.Generator().manual_seed(3)).tolist()
    for row, pick in zip(written, picks):
        assert torch.equal(row[:10], window(stream, SEQ_LEN, pick)[:10].long())
        # Greedy: every written token is the target's argmax after what precedes it (up to float
        # noise between the cached steps and this one full pass; a random target's logits are close).
        with torch.no_grad():
            logits = target(input_ids=row[None, :-1], use_cache=False).logits[0, 9:]
        chosen = logits.gather(1, row[10:, None])[:, 0]
        assert torch.all(chosen >= logits.max(-1).values - 1e-4)
        assert not torch.equal(row[10:], window(stream, SEQ_LEN, pick)[10:].long())  # not the corpus's text
    again = own_text_windows(target, stream, SEQ_LEN, own, seed=3, compute=EAGER_FP32, progress=False)
    assert torch.equal(written, again)


def test_batches_keep_the_corpus_order_and_cycle_the_targets_windows(stream):
    own = torch.arange(3 * (SEQ_LEN + 1)).reshape(3, SEQ_LEN + 1) + 10_000  # told apart from corpus tokens
    mixed = MixedSampler(WindowSampler(stream, SEQ_LEN, 1), own, per_batch=1, seed=2)
    plain = WindowSampler(stream, SEQ_LEN, 1)
    seen = []
    for _ in range(6):
        batch = mixed.next_batch(4)
        assert batch.shape == (4, SEQ_LEN + 1)
        assert torch.equal(batch[:3], plain.next_batch(3))
        seen.append(int(batch[3, 0]) // (SEQ_LEN + 1))
    assert {int(r) for r in seen} == {int(w[0]) // (SEQ_LEN + 1) for w in own}  # each once per pass
    assert sorted(seen[:3]) == sorted(seen[3:])


def test_bad_settings_are_refused_with_what_is_wrong(stream):
    with pytest.raises(ValueError, match="must be >= 1"):
        OwnText(num_windows=0, per_batch=1, prompt_len=8)
    target = build_model(TINY_TARGET, seed=0)
    with pytest.raises(ValueError, match="leaves nothing"):
        own_text_windows(target, stream, SEQ_LEN, OwnText(2, 1, SEQ_LEN + 1), 0, EAGER_FP32, progress=False)
    mixed = MixedSampler(WindowSampler(stream, SEQ_LEN, 1), torch.zeros(2, SEQ_LEN + 1, dtype=torch.long), 4, 0)
    with pytest.raises(ValueError, match="no corpus window"):
        mixed.next_batch(4)
