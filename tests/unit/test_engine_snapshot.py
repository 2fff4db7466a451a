"""engine/snapshot.py: what other threads read about an engine is a frozen snapshot the engine's
own thread publishes after each step (and the serving loop after each turn), never the live
scheduler or page manager."""

from __future__ import annotations

import dataclasses

import pytest

from configs import EngineConfig
from engine import LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return LLMEngine(EngineConfig(model=str(tiny_dir), page_size=16, num_pages=32, max_num_batched_tokens=64))


def test_snapshot_follows_steps_and_explicit_publishes(engine):
    empty = engine.snapshot
    assert (empty.num_running, empty.num_waiting, empty.referenced_pages, empty.num_pages) == (0, 0, 0, 32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        empty.num_running = 1  # readers on other threads can never see a half-written state
    engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=3, ignore_eos=True))
    assert engine.snapshot is empty  # nothing published between steps by itself
    published = engine.publish_snapshot()
    assert engine.snapshot is published and published.num_waiting == 1
    engine.step()  # prefill (37 tokens, 3 pages) and the first token
    snap = engine.snapshot
    assert (snap.num_running, snap.num_waiting, snap.referenced_pages, snap.num_steps) == (1, 0, 3, published.num_steps + 1)
    assert snap.page_stats() == engine.page_stats()
    while engine.has_unfinished_requests():
        engine.step()
    done = engine.snapshot
    assert (done.num_running, done.referenced_pages) == (0, 0)
    assert done.cached_pages == 2 and done.prefix_queried_tokens == 37  # two full pages cached for reuse
