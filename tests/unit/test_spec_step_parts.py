"""benchmarks/spec_step_parts.py counts a request's decode steps and their tokens, the prefill
step left out, and times the parts it names (the draft's proposals only where a draft ran)."""

from __future__ import annotations

import sys
from pathlib import Path

from configs import EngineConfig
from engine import LLMEngine, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import spec_step_parts
from step_breakdown import PartTimers

PARTS = {"step", "proposals", "build + forward", "forward", "vocabulary projection", "verification"}


def test_decode_steps_and_parts_by_method(loopy_dir, loopy_draft_dir):
    engine = LLMEngine(EngineConfig(model=str(loopy_dir), page_size=8, enable_prefix_caching=False, speculative={
        "method": "prompt_lookup", "num_tokens": 3, "adaptive": False, "cost_policy": False,
        "draft_model": str(loopy_draft_dir)}))
    timers = PartTimers()
    spec_step_parts.instrument(engine, timers)
    prompt = [0] + list(range(3, 40))
    plain = SamplingParams(max_tokens=9, ignore_eos=True, speculative_method="none")
    assert spec_step_parts.decode_request(engine, "plain", prompt, plain, timers) == (8, 8)  # the prefill's token out
    assert set(timers.seconds) == PARTS
    parts = sum(timers.seconds[p] for p in ("proposals", "build + forward", "vocabulary projection", "verification"))
    assert timers.seconds["step"] >= parts and timers.seconds["build + forward"] >= timers.seconds["forward"]

    timers.reset()
    drafted = SamplingParams(max_tokens=9, ignore_eos=True, speculative_method="draft")
    steps, tokens = spec_step_parts.decode_request(engine, "drafted", prompt, drafted, timers)
    assert tokens == 8 and 1 <= steps <= 8
    assert set(timers.seconds) == PARTS | {"draft proposals"}
    assert timers.seconds["proposals"] >= timers.seconds["draft proposals"] > 0
    assert not engine.has_unfinished_requests()
