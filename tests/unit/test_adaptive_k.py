"""engine/spec/adaptive.py and guess_cost.py: a request's k from its acceptance rate and what a
proposed token costs, pauses with one-token probes, and the guess costs the proposers declare."""

from __future__ import annotations

import pytest

from engine.model.config import ModelConfig
from engine.model.medusa_heads import MedusaConfig
from engine.spec.adaptive import MAX_PAUSE_STEPS, SpecState, best_k
from engine.spec.guess_cost import decode_weights, draft_guess_cost, medusa_guess_cost


def test_best_k_rises_with_acceptance_and_falls_with_cost():
    assert best_k(0.99, 8, 0.1) == 8
    assert best_k(0.0, 8, 0.1) == 0
    by_rate = [best_k(a / 10, 8, 0.4) for a in range(10)]
    assert by_rate == sorted(by_rate) and by_rate[0] == 0 and 0 < by_rate[-1] < 8
    by_cost = [best_k(0.85, 8, c) for c in (0.05, 0.2, 0.4, 0.8, 2.0)]
    assert by_cost == sorted(by_cost, reverse=True) and by_cost[0] == 8 and by_cost[-1] == 0


def test_k_follows_the_recent_acceptance_rate():
    state = SpecState("draft", max_k=6, guess_cost=0.3)
    first = state.next_k()
    assert 0 < first < 6  # the prior (3 in 4) at this cost
    for _ in range(10):
        state.record(6, 6)  # every guess right
    assert state.acceptance > 0.95 and state.next_k() == 6
    state.record(6, 1)
    assert state.next_k() == 6  # one miss after sixty hits: the rate stays high
    for _ in range(3):
        state.record(6, 1)
    assert 0 < state.next_k() < 6  # a run of them lowers it
    for _ in range(10):
        state.record(6, 6)
    assert state.next_k() == 6  # recent verifications weigh most
    assert (state.num_proposed, state.num_accepted, state.num_verified) == (24 * 6, 20 * 6 + 4, 24)


def test_a_rate_that_does_not_pay_pauses_with_one_token_probes_and_a_doubling_backoff():
    state = SpecState("draft", max_k=4, guess_cost=0.3)
    for _ in range(12):
        state.record(4, 0)
    ks = []
    for _ in range(1 + 1 + 1 + 1 + 2 + 1):  # zero, a pause of 1, a probe, zero, a pause of 2, a probe
        k = state.next_k()
        ks.append(k)
        if k:
            state.record(k, 0)  # the probe's token is wrong too
    assert ks == [0, 0, 1, 0, 0, 0, 1]
    assert state.next_k() == 0 and state.pause_steps == 4  # the pause keeps doubling ...
    state.pause_steps, state.backoff_steps = 0, 64
    state.next_k()
    assert state.backoff_steps == MAX_PAUSE_STEPS  # ... up to its cap
    state.pause_steps, state.probe_due = 0, True
    assert state.next_k() == 1
    for _ in range(6):
        state.record(1, 1)  # the probes are right: it pays again, and the back-off resets
    assert state.next_k() > 0 and state.backoff_steps == 1


def test_a_bigger_step_proposes_fewer_tokens():
    state = SpecState("prompt_lookup", max_k=8)
    state.record(8, 5)
    ks = [state.next_k(num_step_seqs=n) for n in (1, 2, 4, 8, 16)]
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1] == 0


def test_not_adaptive_or_alone_with_free_guesses_the_maximum():
    fixed = SpecState("prompt_lookup", max_k=3, adaptive=False)
    for _ in range(20):
        fixed.record(3, 0)
    assert fixed.next_k(num_step_seqs=16) == 3
    state = SpecState("prompt_lookup", max_k=4)
    for _ in range(20):
        state.record(4, 0)
    assert state.next_k(num_step_seqs=2) == 0 and state.pause_steps == 1
    assert state.next_k(alone_and_free=True) == 4  # alone, rows are nearly free: no pause
    assert state.pause_steps == 1  # kept for the next shared step


def test_decode_weights_count_what_a_decode_step_multiplies_by(tiny_dir, hf_tiny):
    cfg = ModelConfig.from_dir(tiny_dir)
    layers, projection = decode_weights(cfg)
    linear = sum(p.numel() for p in hf_tiny.model.layers.parameters() if p.dim() == 2)  # norms are 1-D
    assert layers == linear
    assert projection == cfg.vocab_size * cfg.hidden_size
    assert decode_weights(cfg, 64)[1] == 64 * cfg.hidden_size


def test_guess_costs_weigh_a_proposers_weights_against_the_targets(tiny_dir):
    target = ModelConfig.from_dir(tiny_dir)
    assert draft_guess_cost(target, target, None, False) == pytest.approx(1.0)
    half = ModelConfig.from_hf_dict({**_hf(tiny_dir), "num_hidden_layers": target.num_layers // 2})
    layers, projection = decode_weights(target)
    assert draft_guess_cost(half, target, None, False) == pytest.approx((layers / 2 + projection) / (layers + projection))
    assert draft_guess_cost(half, target, 64, True) < draft_guess_cost(half, target, 64, False) < \
        draft_guess_cost(half, target, None, False)
    heads = MedusaConfig(3, 1, target.hidden_size, target.vocab_size)
    assert medusa_guess_cost(heads, target) == pytest.approx(
        (target.hidden_size ** 2 + projection) / (layers + projection))


def _hf(model_dir) -> dict:
    import json

    return json.loads((model_dir / "config.json").read_text())
