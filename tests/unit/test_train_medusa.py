"""Fitting Medusa heads (engine/model/train_medusa.py) on a tiny recipe and a few stdlib files:
the loss pairs each hidden state with the right future token, the heads start as Medusa's do,
a few steps lower the held-out loss, and what is written loads back as Medusa heads."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from engine.model import train_corpus
from engine.model.medusa_heads import MedusaConfig, MedusaHeads, load_medusa_heads
from engine.model.train import train_checkpoint
from engine.model.train_loop import Compute
from engine.model.train_medusa import init_heads, medusa_losses, train_medusa_checkpoint
from engine.model.train_model import build_model, load_hf_model
from tests.train_helpers import TINY_SETTINGS, TINY_TARGET, small_stdlib_corpus

EAGER_FP32 = Compute(threads=2, bf16=False, compile=False)


def test_head_i_is_scored_against_the_token_i_plus_2_ahead():
    """With one-hot 'hidden states' and heads that copy them to the vocabulary, head i's loss is
    lowest when position t's state encodes token t + 2 + i, with hard labels and soft ones."""
    vocab, seq = 8, 6
    tokens = torch.tensor([[1, 5, 2, 7, 3, 0, 4]])  # a window: seq inputs + 1
    heads = MedusaHeads(MedusaConfig(2, 0, vocab, vocab))
    with torch.no_grad():
        for i in range(2):
            heads.projection(i).weight.copy_(torch.eye(vocab) * 50)
    for shift in (2, 3):
        # hidden at t = one-hot of token t + shift (zeros past the window)
        future = torch.cat([tokens[0, shift:], torch.zeros(shift - 1, dtype=torch.long)])[:seq]
        hidden = F.one_hot(future, vocab).float()[None]
        losses = [float(x.detach()) for x in medusa_losses(heads, hidden, tokens)]
        right = shift - 2  # the head this shift is right for
        assert losses[right] < 1e-6 and losses[1 - right] > 1.0, (shift, losses)
        # Soft labels from a target sure of the text (its logits at p put everything on token p + 1):
        # the same verdicts, read from the target's position t + 1 + i.
        sure = F.one_hot(tokens[0, 1:], vocab).float()[None] * 50
        soft = [float(x.detach()) for x in medusa_losses(heads, hidden, tokens, sure)]
        assert soft[right] < 1e-6 and soft[1 - right] > 1.0, (shift, soft)


def test_heads_start_as_identity_blocks_and_the_targets_projection():
    target = build_model(TINY_TARGET, seed=0)
    heads = init_heads(MedusaConfig(2, 1, TINY_TARGET.hidden_size, TINY_TARGET.vocab_size), target)
    hidden = torch.randn(3, TINY_TARGET.hidden_size, generator=torch.Generator().manual_seed(0))
    expected = hidden @ target.get_output_embeddings().weight.T
    torch.testing.assert_close(heads.head_logits(hidden), torch.stack([expected, expected]))


@pytest.mark.slow
def test_a_few_steps_lower_the_held_out_loss_and_write_loadable_heads(tmp_path, monkeypatch):
    corpus_root = small_stdlib_corpus(tmp_path / "stdlib")
    monkeypatch.setattr(train_corpus, "stdlib_dir", lambda: corpus_root)
    target_dir = tmp_path / "target"
    train_checkpoint(target_dir, "tiny-target", TINY_TARGET, replace(TINY_SETTINGS, steps=20), EAGER_FP32)
    settings = replace(TINY_SETTINGS, steps=30, seed=3)
    reports = [train_medusa_checkpoint(target_dir, tmp_path / out, "tiny-medusa", "tiny-target", 2, 1, settings,
                                       EAGER_FP32) for out in ("a", "b")]
    report = reports[0]
    # A 20-step target's hidden states say little about tokens 2 and 3 ahead: the heads gain on the
    # lm_head copies they start from, but not much (measured: 5.30 -> 5.22 nats for both heads).
    for before, after in zip(report.before.losses, report.after.losses):
        assert after < before - 0.05, (report.before, report.after)
    assert reports[1].after == report.after  # seeded: the same run twice
    assert "held-out loss" in report.summary() and "head 1 (token +3)" in report.summary()
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config == {"medusa_num_heads": 2, "medusa_num_layers": 1, "hidden_size": TINY_TARGET.hidden_size,
                      "vocab_size": TINY_TARGET.vocab_size, "base_model_name_or_path": "tiny-target"}
    heads = load_medusa_heads(tmp_path / "a", TINY_TARGET.hidden_size, TINY_TARGET.vocab_size, torch.float32, "cpu")
    assert len(heads) == 2

    # Tied: only the blocks learn; every projection written is still the target's own.
    tied = train_medusa_checkpoint(target_dir, tmp_path / "tied", "tiny-medusa", "tiny-target", 2, 1,
                                   replace(settings, steps=5), EAGER_FP32, tied_projection=True)
    assert tied.tied_projection and "projections tied to the target's" in tied.summary()
    output = load_hf_model(target_dir).get_output_embeddings().weight
    heads = load_medusa_heads(tmp_path / "tied", TINY_TARGET.hidden_size, TINY_TARGET.vocab_size, torch.float32, "cpu")
    for i in range(2):
        assert torch.equal(heads.projection(i).weight, output)
    assert not torch.equal(heads.blocks(0)[0].linear.weight, torch.zeros_like(heads.blocks(0)[0].linear.weight))
