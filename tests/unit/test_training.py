"""The trainers on a tiny recipe and a few stdlib files: training lowers the held-out loss,
distillation lowers the KL to the target, and the same seed gives the same bytes."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import replace

import pytest
import torch

from engine.model import train_corpus
from engine.model.distill import distill, held_out_agreement, init_from_target, kl_to_target
from engine.model.hf_files import ModelShape, write_bpe_tokenizer
from engine.model.train import held_out_loss, train, train_checkpoint
from engine.model.train_corpus import WindowSampler, held_out_windows, split_corpus, token_stream
from engine.model.train_loop import Compute, learning_rate
from engine.model.train_model import build_model
from tests.train_helpers import TINY_DRAFT, TINY_SETTINGS, TINY_TARGET, small_stdlib_corpus

EAGER_FP32 = Compute(threads=2, bf16=False, compile=False)
FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
         "pdserve_builtin.json"]


@pytest.fixture(scope="module")
def corpus_root(tmp_path_factory):
    return small_stdlib_corpus(tmp_path_factory.mktemp("stdlib"))


@pytest.fixture(scope="module")
def streams(corpus_root, tmp_path_factory):
    """(train stream, held-out windows) of the small corpus under a 512-token BPE fitted on its train split."""
    split = split_corpus(corpus_root)
    tok_dir = tmp_path_factory.mktemp("tok")
    write_bpe_tokenizer(tok_dir, 512, 64, split.train_lines())
    train_stream = token_stream(tok_dir / "tokenizer.json", [split.read(f) for f in split.train])
    held = token_stream(tok_dir / "tokenizer.json", [split.read(f) for f in split.held_out])
    return train_stream, held_out_windows(held, TINY_SETTINGS.seq_len, TINY_SETTINGS.eval_windows)


def digests(path) -> dict[str, str]:
    return {f: hashlib.sha256((path / f).read_bytes()).hexdigest() for f in FILES}


def test_learning_rate_warms_up_then_decays_to_the_floor():
    s = replace(TINY_SETTINGS, steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    lrs = [learning_rate(i, s) for i in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a < b for a, b in zip(lrs[:9], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(1e-4)


def test_kl_is_zero_for_the_same_distribution_and_matches_its_definition():
    gen = torch.Generator().manual_seed(0)
    t, d = torch.randn(2, 3, 11, generator=gen), torch.randn(2, 3, 11, generator=gen)
    assert kl_to_target(t, t).item() == pytest.approx(0.0, abs=1e-6)
    assert kl_to_target(t, t + 5.0).item() == pytest.approx(0.0, abs=1e-5)  # logits, not probabilities
    p, q = torch.softmax(t, -1), torch.softmax(d, -1)
    expected = (p * (p.log() - q.log())).sum(-1).mean()
    assert kl_to_target(t, d).item() == pytest.approx(expected.item(), rel=1e-5)
    assert kl_to_target(t, d).item() > 0.1


def test_the_init_is_seeded_and_a_draft_starts_from_the_targets_shared_tensors():
    a, b = build_model(TINY_TARGET, seed=3), build_model(TINY_TARGET, seed=3)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    assert not torch.equal(a.model.embed_tokens.weight, build_model(TINY_TARGET, seed=4).model.embed_tokens.weight)
    assert a.model.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert ModelShape.of(a) == TINY_TARGET
    assert sum(p.numel() for p in a.parameters()) == TINY_TARGET.num_parameters()

    draft = build_model(TINY_DRAFT, seed=5)
    copied = init_from_target(draft, a)
    assert "model.embed_tokens.weight" in copied and "model.norm.weight" in copied
    assert "model.layers.0.mlp.down_proj.weight" in copied
    assert not any(name.startswith("model.layers.1.") for name in copied)
    assert torch.equal(draft.model.layers[0].self_attn.q_proj.weight, a.model.layers[0].self_attn.q_proj.weight)
    narrow = build_model(replace(TINY_DRAFT, hidden_size=32, intermediate_size=64), seed=5)
    assert init_from_target(narrow, a) == []  # nothing has the target's width


@pytest.mark.slow
def test_a_few_training_steps_lower_the_held_out_loss(streams):
    train_stream, held = streams
    model = build_model(TINY_TARGET, TINY_SETTINGS.seed)
    before = held_out_loss(model, held, EAGER_FP32, 8)
    assert before == pytest.approx(math.log(512), abs=0.3)  # an untrained model guesses near-uniformly
    stats = train(model, WindowSampler(train_stream, TINY_SETTINGS.seq_len, 0), replace(TINY_SETTINGS, steps=30),
                  EAGER_FP32)
    after = held_out_loss(model, held, EAGER_FP32, 8)
    assert stats.steps == 30 and not stats.compiled
    assert after < before - 1.0, (before, after)


def test_distillation_lowers_the_kl_to_the_target(streams):
    train_stream, held = streams
    target = build_model(TINY_TARGET, seed=0)
    train(target, WindowSampler(train_stream, TINY_SETTINGS.seq_len, 0), TINY_SETTINGS, EAGER_FP32)
    # Narrower than the target: it shares no tensor with it, so only distillation can bring it close.
    draft = build_model(replace(TINY_DRAFT, hidden_size=32, intermediate_size=64), seed=1)
    before = held_out_agreement(draft, target, held, EAGER_FP32, 8)
    distill(draft, target, WindowSampler(train_stream, TINY_SETTINGS.seq_len, 1), replace(TINY_SETTINGS, steps=30),
            EAGER_FP32)
    after = held_out_agreement(draft, target, held, EAGER_FP32, 8)
    assert after.kl < 0.6 * before.kl, (before, after)
    assert after.top1_agreement > before.top1_agreement + 0.1, (before, after)
    assert after.target_loss == pytest.approx(before.target_loss)  # the target is left alone
    for p in target.parameters():
        assert not p.requires_grad


def test_distillation_needs_the_targets_vocabulary():
    target = build_model(TINY_TARGET, seed=0)
    draft = build_model(replace(TINY_DRAFT, vocab_size=256), seed=0)
    with pytest.raises(ValueError, match="must share its target's tokenizer"):
        distill(draft, target, WindowSampler(torch.arange(1000, dtype=torch.int32), 64, 0), TINY_SETTINGS,
                EAGER_FP32)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_the_same_seed_gives_the_same_bytes(corpus_root, monkeypatch, tmp_path, bf16):
    monkeypatch.setattr(train_corpus, "stdlib_dir", lambda: corpus_root)
    compute = Compute(threads=2, bf16=bf16, compile=False)
    settings = replace(TINY_SETTINGS, steps=4)
    reports = [train_checkpoint(tmp_path / d, "tiny-test", TINY_TARGET, settings, compute) for d in ("a", "b")]
    assert digests(tmp_path / "a") == digests(tmp_path / "b")
    assert reports[0].held_out_loss == reports[1].held_out_loss
    about = json.loads((tmp_path / "a" / "pdserve_builtin.json").read_text())
    assert about["settings"]["steps"] == 4 and about["compute"]["bf16"] == bf16
    assert about["corpus"]["held_out_files"] == 2

    train_checkpoint(tmp_path / "c", "tiny-test", TINY_TARGET, replace(settings, seed=1), compute)
    other = digests(tmp_path / "c")
    assert other["tokenizer.json"] == digests(tmp_path / "a")["tokenizer.json"]  # the seed is not the tokenizer's
    assert other["model.safetensors"] != digests(tmp_path / "a")["model.safetensors"]


@pytest.mark.slow
def test_compiled_training_is_deterministic_and_close_to_eager(streams):
    train_stream, held = streams
    results = []
    for compile in (True, True, False):
        model = build_model(TINY_TARGET, 0)
        compute = Compute(threads=2, bf16=False, compile=compile)
        stats = train(model, WindowSampler(train_stream, 64, 0), replace(TINY_SETTINGS, steps=6), compute)
        assert stats.compiled == compile
        results.append((model.state_dict(), held_out_loss(model, held, compute, 8)))
    (a, loss_a), (b, loss_b), (_, loss_eager) = results
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert loss_a == loss_b
    assert loss_a == pytest.approx(loss_eager, abs=0.05)
