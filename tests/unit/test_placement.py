"""Per-request placement (router/placement/): the cost model's predictions and the choice made
from scripted measurements, the priors for unmeasured workers, and the KV block index under
lost, duplicated and reordered events."""

from __future__ import annotations

import asyncio
import time

import pytest

from proto import worker_messages as wm
from proto.block_hash import hash_full_pages, short_hash
from router.placement.block_index import BlockIndex
from router.placement.candidates import decode_sides, local_queue, prefill_sides, prior_rates, remote_options
from router.placement.cost_model import (
    DecodeSide,
    LinkCost,
    PrefillSide,
    local_stall_s,
    local_ttft_s,
    remote_ttft_s,
    transfer_s,
)
from router.placement.decide import PlacementSettings, RemoteOption, choose
from router.policy import WorkerLoad
from router.prefill_gate import PrefillGate

FAST_LINK = LinkCost(latency_s=0.001, bytes_per_s=1e9)


def test_the_cost_model_predicts_queue_compute_and_transfer_from_measured_rates():
    p = PrefillSide("p0", tokens_per_s=1000.0, queued_tokens=500, cached_tokens=100)
    assert remote_ttft_s(p, 300) == pytest.approx((500 + 200) / 1000)
    assert remote_ttft_s(p, 300, ahead_tokens=300) == pytest.approx((500 + 300 + 200) / 1000)
    assert remote_ttft_s(p, 50) == pytest.approx((500 + 1) / 1000)  # all cached: still the last token
    assert transfer_s(FAST_LINK, 1_000_000) == pytest.approx(0.002)
    assert transfer_s(LinkCost(latency_s=0.003), 10**9) == 0.003  # bandwidth not measured: latency only
    d = DecodeSide("d0", tokens_per_s=800.0, decode_step_s=0.02, queued_tokens=160, running=4, cached_tokens=64)
    assert local_ttft_s(d, 224) == pytest.approx((160 + 160) / 800 + 0.02)
    assert local_stall_s(d, 224) == pytest.approx(160 / 800)


def remote(worker: str = "p0", rate: float = 1000.0, queued: int = 0) -> RemoteOption:
    return RemoteOption(PrefillSide(worker, rate, queued), FAST_LINK)


def decode(worker: str = "d0", rate: float = 1000.0, running: int = 0, queued: int = 0, cached: int = 0,
           step_s: float = 0.01) -> DecodeSide:
    return DecodeSide(worker, rate, step_s, queued, running, cached)


ADAPTIVE = PlacementSettings("adaptive")


def test_adaptive_keeps_an_idle_prefill_pool_and_moves_a_queued_prompt_to_an_idle_decode_worker():
    idle = choose(ADAPTIVE, 200, 1024, [remote()], [decode()])
    assert (idle.kind, idle.reason, idle.prefill) == ("remote", "faster", "p0")
    queued = choose(ADAPTIVE, 200, 1024, [remote(queued=4000)], [decode()])
    assert (queued.kind, queued.reason, queued.decode) == ("local", "prefill_queue", "d0")
    assert queued.predicted_ttft_s == pytest.approx(200 / 1000 + 0.01)
    # the same queue, but in the router's queue ahead of this request rather than on the worker
    ahead = choose(ADAPTIVE, 200, 1024, [remote()], [decode()], ahead_tokens=4000)
    assert (ahead.kind, ahead.reason) == ("local", "prefill_queue")


def test_adaptive_weighs_the_stall_a_local_prompt_puts_on_running_requests():
    # 1.0 s of prefill queue against a 0.2 s local prefill: with 4 running at weight 0.5 local
    # costs 0.21 + 0.5 x 0.2 x 4 = 0.61 < 0.8 x 1.2, so local; with 12 running 1.41, so remote.
    assert choose(ADAPTIVE, 200, 1024, [remote(queued=1000)], [decode(running=4)]).kind == "local"
    assert choose(ADAPTIVE, 200, 1024, [remote(queued=1000)], [decode(running=12)]).kind == "remote"
    light = PlacementSettings("adaptive", stall_weight=0.0)
    assert choose(light, 200, 1024, [remote(queued=1000)], [decode(running=12)]).kind == "local"


def test_a_tie_stays_remote_by_the_margin():
    # remote 0.2 s + transfer, local 0.2 s + 0.01 step: within 20%, so remote
    assert choose(ADAPTIVE, 200, 1024, [remote()], [decode(step_s=0.0)]).kind == "remote"
    eager = PlacementSettings("adaptive", margin=0.0)
    assert choose(eager, 200, 1024, [remote(rate=900.0)], [decode(step_s=0.0)]).kind == "local"


def test_a_decode_worker_holding_the_prefix_computes_only_the_suffix():
    """1,000 of 1,024 tokens cached on d1: its local cost is 25 tokens, far below any remote one."""
    d0, d1 = decode("d0"), decode("d1", cached=1000)
    placement = choose(ADAPTIVE, 1024, 1024, [remote()], [d0, d1])
    assert (placement.kind, placement.decode, placement.reason) == ("suffix", "d1", "faster")


def test_the_cheapest_of_several_prefill_workers_and_links():
    slow_link = RemoteOption(PrefillSide("p1", 1000.0, 0), LinkCost(0.5, 1e6))
    placement = choose(PlacementSettings("always"), 200, 1024, [slow_link, remote("p2")], [decode()])
    assert placement.prefill == "p2"


def test_always_and_never_and_the_fallbacks():
    always, never = PlacementSettings("always"), PlacementSettings("never")
    busy = [remote(queued=10**6)]
    assert (choose(always, 200, 1024, busy, [decode()]).kind, choose(always, 200, 1024, busy, [decode()]).reason) \
        == ("remote", "always")
    assert choose(never, 200, 1024, [remote()], [decode("d0", running=3), decode("d1")]).decode == "d1"
    assert choose(never, 200, 1024, [remote()], [decode()]).reason == "never"
    for settings in (always, ADAPTIVE):  # no prefill worker can take it: the decode worker computes it
        fallback = choose(settings, 200, 1024, [], [decode()])
        assert (fallback.kind, fallback.reason) == ("local", "no_prefill_worker")
        assert choose(settings, 200, 1024, [], [decode()], why_no_remote="kv_link_down").reason == "kv_link_down"
        assert choose(settings, 200, 1024, [], []) is None
    assert choose(ADAPTIVE, 200, 1024, [remote()], []).kind == "remote"


def test_nothing_measured_yet_goes_remote_by_queue_and_a_slow_decode_worker_takes_no_local_prompt():
    placement = choose(ADAPTIVE, 200, 1024, [remote("p0", rate=0.0, queued=9), remote("p1", rate=0.0)],
                       [decode(rate=0.0)])
    assert (placement.kind, placement.reason, placement.prefill, placement.predicted_ttft_s) == \
        ("remote", "unmeasured", "p1", None)
    tight = PlacementSettings("adaptive", tpot_target_s=0.05, max_local_step_share=0.8)
    slow = decode(step_s=0.045)  # past 0.8 x 50 ms already
    assert choose(tight, 200, 1024, [remote(queued=10**5)], [slow]).kind == "remote"
    assert choose(tight, 200, 1024, [], [slow]) is None  # nowhere to put it then


def test_unknown_modes_are_refused():
    with pytest.raises(ValueError, match="unknown disaggregation 'sometimes'"):
        PlacementSettings("sometimes")


def test_candidates_get_priors_and_the_routers_fresher_queues():
    prefills = [WorkerLoad("p0", prefill_tokens_per_s=2000.0, queued_tokens=7), WorkerLoad("p1", healthy=False)]
    decodes = [WorkerLoad("d0", running=3, decode_step_s=0.02, queued_tokens=50), WorkerLoad("d1")]
    assert prior_rates(prefills, decodes) == (2000.0, 2000.0)  # decode's prior from the prefill pool
    assert prior_rates([WorkerLoad("p0")], [WorkerLoad("d0", prefill_tokens_per_s=500.0)]) == (500.0, 500.0)
    queue = local_queue()
    queue.add("d1", 300)
    ps = prefill_sides(prefills, {"p0": 900}.get, {"p0": 32}.get, 2000.0)
    ds = decode_sides(decodes, queue.tokens, {"d0": 0, "d1": 16}.get, 2000.0)
    assert ps == [PrefillSide("p0", 2000.0, 900, 32)]  # the gate's count, not the heartbeat's 7
    assert ds == [DecodeSide("d0", 2000.0, 0.02, 50, 3, 0), DecodeSide("d1", 2000.0, 0.0, 300, 0, 16)]
    links = {("p0", "d1"): LinkCost(0.002, 1e9)}
    [option] = remote_options(ps, ds, lambda p, d: links.get((p, d)))
    assert option.link == LinkCost(0.002, 1e9)
    assert remote_options(ps, ds, lambda p, d: None) == []
    queue.done("d1", 300)
    assert queue.tokens("d1") == 0
    with pytest.raises(RuntimeError, match="released 1 tokens"):
        queue.done("d1", 1)


def blocks(worker: str, seq: int, stored=(), removed=(), incarnation: str = "a", lost: bool = False) -> wm.KVBlocks:
    return wm.KVBlocks(worker, incarnation, seq, tuple(stored), tuple(removed), lost)


PROMPT = list(range(64))  # 4 pages of 16


def test_the_block_index_finds_each_workers_leading_run_as_the_workers_hash_it():
    index = BlockIndex(page_size=16)
    hashes = index.prompt_hashes(PROMPT)
    assert hashes == [short_hash(h) for h in hash_full_pages(PROMPT, 16)]
    index.apply(blocks("d0", 0, stored=hashes[:3]))
    index.apply(blocks("d1", 0, stored=hashes[1:]))  # no first page: no run
    assert index.cached_tokens(hashes, ["d0", "d1", "d2"]) == {"d0": 48, "d1": 0, "d2": 0}
    index.apply(blocks("d0", 1, removed=hashes[1:2]))
    assert index.cached_tokens(hashes, ["d0"]) == {"d0": 16}
    with pytest.raises(ValueError, match="page_size"):
        BlockIndex(0)
    assert BlockIndex(page_size=8).prompt_hashes(PROMPT) != hashes  # the configured page size, not 16


def test_lost_duplicated_and_reordered_events_cost_at_most_a_miss():
    index = BlockIndex(page_size=16)
    hashes = index.prompt_hashes(PROMPT)
    index.apply(blocks("d0", 0, stored=hashes))
    index.apply(blocks("d0", 0, stored=hashes))  # a duplicate: no change
    index.apply(blocks("d0", 1, removed=hashes[3:]))
    index.apply(blocks("d0", 1, removed=hashes[3:]))
    assert index.cached_tokens(hashes, ["d0"]) == {"d0": 48}
    index.apply(blocks("d0", 0, stored=hashes))  # a late one (older than what is applied): ignored
    assert index.cached_tokens(hashes, ["d0"]) == {"d0": 48}
    index.apply(blocks("d0", 3, stored=hashes[:1]))  # seq 2 was lost: forget d0, keep what this says
    assert index.cached_tokens(hashes, ["d0"]) == {"d0": 16} and index.num_resets == 1
    index.apply(blocks("d0", 0, stored=hashes, incarnation="b"))  # a new process under the old id
    assert index.cached_tokens(hashes, ["d0"]) == {"d0": 64} and index.num_resets == 2
    index.apply(blocks("d0", 1, stored=(), incarnation="b", lost=True))  # it dropped changes itself
    assert index.cached_tokens(hashes, ["d0"]) == {"d0": 0}
    index.apply(blocks("d1", 0, stored=hashes))
    index.forget("d1")
    assert index.cached_tokens(hashes, ["d1"]) == {"d1": 0} and len(index) == 0


def test_the_block_index_is_bounded_least_recently_used_first():
    index = BlockIndex(page_size=16, capacity=4)
    hashes = index.prompt_hashes(PROMPT)
    index.apply(blocks("d0", 0, stored=hashes))
    assert index.cached_tokens(hashes[:2], ["d0"]) == {"d0": 32}  # the first two pages were looked up
    index.apply(blocks("d1", 0, stored=hashes[:2]))  # two more entries: the two least recent go
    assert len(index) == 4
    assert index.cached_tokens(hashes, ["d0", "d1"]) == {"d0": 32, "d1": 32}


def test_a_request_waiting_for_prefill_room_leaves_the_queue_when_told_to():
    async def scenario():
        gate = PrefillGate(100)
        far = time.monotonic() + 5
        held = await gate.acquire(100, lambda full: None if "p0" in full else "p0", far, TimeoutError)
        asked: list[int] = []

        def reconsider(ahead: int) -> bool:
            asked.append(ahead)
            return len(asked) >= 3

        waiting = asyncio.ensure_future(gate.acquire(50, lambda full: None if "p0" in full else "p0", far,
                                                     TimeoutError, recheck_s=0.01, reconsider=reconsider))
        await asyncio.sleep(0)
        assert gate.waiting_tokens == 50
        assert await waiting is None  # moved elsewhere: no credit taken
        assert gate.outstanding("p0") == 100 and gate.num_waiting == 0 and asked[0] == 0
        gate.release(held, 100)

    asyncio.run(scenario())


class _PoolWithCache:
    """What Placer.place reads of a pool: one prefill and one decode worker, measured, the decode
    worker holding the prompt's first 4 pages (its KV block events)."""

    def __init__(self, hashes: list[int]) -> None:
        self.blocks = BlockIndex(16)
        self.blocks.apply(blocks("d0", 0, stored=hashes[:4]))

    def loads(self, role: str) -> list[WorkerLoad]:
        return [WorkerLoad("p0" if role == "prefill" else "d0", True, 0, 100, 0, 0, 1000.0, 0.01)]

    def kv_route(self, prefill: str, decode: str) -> str:
        return "127.0.0.1:1"

    def link_cost(self, prefill: str, address: str) -> LinkCost:
        return LinkCost(1e-4, 1e9)

    def kv_bytes_per_token(self) -> int:
        return 1024


@pytest.mark.parametrize(("cache_aware", "kind"), [(True, "suffix"), (False, "remote")])
def test_a_cache_blind_placer_does_not_see_the_decode_workers_prefix(cache_aware, kind):
    from router.placement.placer import Placer

    prompt = list(range(1, 81))  # 5 full pages of 16
    hashes = [short_hash(h) for h in hash_full_pages(prompt, 16)]
    placer = Placer(PlacementSettings(cache_aware=cache_aware), PrefillGate(8192))
    assert placer.place(_PoolWithCache(hashes), len(prompt), hashes, 0).kind == kind
