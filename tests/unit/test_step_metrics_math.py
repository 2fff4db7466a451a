"""The pure pieces of live metrics: step work split by phase, the roofline byte/FLOP counts,
the router's SLO judgement and sliding attainment window, the rough peak measurement."""

from __future__ import annotations

import math

import pytest

from engine.metrics.peak import Peak, measure_peak
from engine.metrics.roofline import ModelCost
from engine.metrics.step_stats import StepWork
from engine.model.config import ModelConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from router.slo import SloTargets, SloWindow


def seq(num_prompt: int, num_computed: int, num_generated: int = 0) -> Sequence:
    s = Sequence("r", list(range(num_prompt)), SamplingParams(max_tokens=8), 0, 1000)
    s.token_ids += [1] * num_generated
    s.num_computed_tokens = num_computed
    return s


def test_step_work_splits_prefill_chunks_from_decodes():
    work = StepWork.of([
        ScheduledSeq(seq(10, 0), 4),  # first chunk: positions 0..3 attend 1..4 tokens
        ScheduledSeq(seq(10, 4), 6),  # second chunk: positions 4..9 attend 5..10
        ScheduledSeq(seq(5, 5, num_generated=1), 1),  # decode at position 5: context 6
        ScheduledSeq(seq(3, 2), 1),  # a one-token prompt chunk is still prefill
    ])
    assert work.num_prefill_tokens == 4 + 6 + 1 and work.num_prefill_seqs == 3
    assert work.num_prefill_attended_tokens == (1 + 2 + 3 + 4) + sum(range(5, 11)) + 3
    assert work.num_decode_tokens == 1 and work.num_decode_context_tokens == 6


def tiny_config() -> ModelConfig:
    return ModelConfig("llama", vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
                       num_kv_heads=1, head_dim=4, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1e4,
                       rope_scaling=(), tie_word_embeddings=False, qkv_bias=False, o_bias=False, bos_token_id=0,
                       eos_token_ids=(1,))


def test_roofline_counts():
    cost = ModelCost.of(tiny_config(), weight_bytes=10_000, kv_element_bytes=4)
    # per layer: q 8x8 + k,v 2x(8x4) + o 8x8 + mlp 3x8x16 = 64 + 64 + 64 + 384
    assert cost.matmul_params_per_token == 2 * 576
    assert cost.kv_bytes_per_token == 2 * 2 * 1 * 4 * 4
    work = StepWork(num_prefill_tokens=3, num_prefill_seqs=1, num_prefill_attended_tokens=6,
                    num_decode_tokens=2, num_decode_context_tokens=20)
    assert cost.decode_bytes(work) == 10_000 + 20 * 64
    assert cost.prefill_flops(work) == 2 * 1152 * 3 + 2 * 4 * 8 * 6 + 2 * 100 * 8
    assert cost.decode_bytes(StepWork()) == cost.prefill_flops(StepWork()) == 0


def test_slo_targets():
    both = SloTargets.from_ms(100, 20)
    assert both.met(0.05, 0.01) and both.met(0.1, None)  # one token: no TPOT to miss
    assert not both.met(0.2, 0.01) and not both.met(0.05, 0.03) and not both.met(None, None)
    assert SloTargets().met(99.0, 99.0)  # no targets: every request with a token counts


def test_slo_window_slides():
    now = [0.0]
    window = SloWindow(10.0, clock=lambda: now[0])
    assert math.isnan(window.attainment())
    window.record(True)
    now[0] = 5.0
    window.record(False)
    assert window.attainment() == 0.5
    now[0] = 12.0  # the first outcome left the window
    assert window.attainment() == 0.0


def test_measured_peak_is_positive_and_quick():
    peak = measure_peak(copy_bytes=1 << 20, matmul_size=64, repeats=1)
    assert peak.source == "measured" and peak.memory_bytes_per_s > 0 and peak.flops_per_s > 0
    configured = Peak.configured(100, 2)
    assert configured.memory_bytes_per_s == pytest.approx(1e11) and configured.flops_per_s == pytest.approx(2e12)
