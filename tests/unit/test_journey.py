"""router/journey.py driven by a scripted worker pool: every path of one request's journey (the
happy paths, backpressure, retries after lost workers, failures, deadlines, aborts) in
milliseconds, without sockets or workers. `FakePool` has the methods the journey uses of
router/worker_pool.py's WorkerPool; each command the journey sends is answered by a script
that plays the workers (a function of the command, returning the events they would emit)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import pytest

from proto import pdserve_pb2 as pb
from proto import worker_messages as wm
from router.journey import run_journey
from router.journey_state import Journey, JourneySettings, RouterError
from router.placement.block_index import BlockIndex
from router.placement.cost_model import LinkCost
from router.placement.decide import Placement, PlacementSettings
from router.placement.placer import Placer
from router.policy import WorkerLoad, make_policy
from router.prefill_gate import PrefillGate
from router.tokenizer import RouterTokenizer

SAMPLING = wm.Sampling(max_tokens=4, ignore_eos=True)
PROMPT = (5, 6, 7)
SETTINGS = JourneySettings(mode="disaggregated", kv_timeout_s=5.0, lease_s=5.0, reserve_retry_s=0.001,
                           retry_wait_s=0.0)


class FakePool:
    """Workers by id and role, all healthy; `script(worker_id, command)` -> events to deliver."""

    def __init__(self, workers: dict[str, str], script: Callable[[str, object], list[object]]) -> None:
        self.roles = workers
        self.script = script
        self.sent: list[tuple[str, object]] = []  # (worker id, command), in order
        self.dead: set[str] = set()
        self._queues: dict[str, asyncio.Queue] = {}
        self.involved: dict[str, set[str]] = {}
        self.rejected: list[tuple[str, str]] = []  # (reason, detail) of events the journey refused
        self.down_links: set[tuple[str, str]] = set()  # (prefill, decode) pairs whose KV link is down
        self.fallbacks: dict[str, str] = {}  # decode -> its fallback KV address (torch_dist's ZMQ)
        self.suspected: list[tuple[str, str]] = []  # (prefill, address) of transfers that failed
        self.blocks = BlockIndex(page_size=16)

    def subscribe(self, request_id: str) -> asyncio.Queue:
        self._queues[request_id] = asyncio.Queue()
        return self._queues[request_id]

    def unsubscribe(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def involve(self, request_id: str, worker_id: str) -> None:
        self.involved.setdefault(worker_id, set()).add(request_id)

    def uninvolve(self, request_id: str, worker_id: str) -> None:
        self.involved.get(worker_id, set()).discard(request_id)

    def release(self, request_id: str) -> None:
        for ids in self.involved.values():
            ids.discard(request_id)

    def incarnation(self, worker_id: str) -> str:
        return "1"

    def kv_address(self, worker_id: str) -> str | None:
        return "kv:1" if self.roles.get(worker_id) == "decode" else None  # what happy_workers reserve at

    def kv_route(self, prefill_id: str, decode_id: str) -> str | None:
        if (prefill_id, decode_id) in self.down_links:
            return self.fallbacks.get(decode_id)
        return self.kv_address(decode_id)

    def suspect(self, prefill_id: str, address: str) -> None:
        self.suspected.append((prefill_id, address))

    def link_cost(self, prefill_id: str, address: str) -> LinkCost:
        return LinkCost()

    def kv_bytes_per_token(self) -> int:
        return 1024

    def reject(self, reason: str, detail: str) -> None:
        self.rejected.append((reason, detail))

    def healthy(self, worker_id: str) -> bool:
        return worker_id not in self.dead

    def loads(self, role: str) -> list[WorkerLoad]:
        return [WorkerLoad(w, self.healthy(w), free_pages=100) for w, r in sorted(self.roles.items()) if r == role]

    async def send(self, worker_id: str, message: object) -> None:
        self.sent.append((worker_id, message))
        for event in self.script(worker_id, message):
            queue = self._queues.get(event.request_id)
            if queue is not None:
                queue.put_nowait(event)

    def commands(self, kind: type) -> list[tuple[str, object]]:
        return [(w, m) for w, m in self.sent if isinstance(m, kind)]


def tokens(rid: str, worker: str, ids: tuple[int, ...], finished: bool = False) -> wm.Tokens:
    return wm.Tokens(rid, worker, ids, (), finished, "length" if finished else None)


RESERVED_BY: dict[str, str] = {}  # request id -> the decode worker that reserved it (it streams the tokens)


def happy_workers(worker_id: str, cmd: object) -> list[object]:
    """A disaggregated pair that serves every request: first token 10, then 11, 12, 13."""
    if isinstance(cmd, wm.ReserveKV):
        RESERVED_BY[cmd.request_id] = worker_id
        return [wm.Reserved(cmd.request_id, worker_id, "kv:1", 1, 0)]
    if isinstance(cmd, wm.Prefill):
        rid, rest = cmd.request_id, cmd.sampling.max_tokens - 1
        return [wm.FirstToken(rid, worker_id, 10, None, 0), wm.TransferEnded(rid, worker_id, "done"),
                tokens(rid, RESERVED_BY.get(rid, "d0"), tuple(range(11, 11 + rest)), finished=True)]
    return []


def whole_on_decode(worker_id: str, cmd: object) -> list[object]:
    """A decode worker serving a prompt placed on it (Generate): tokens 10, 11, 12, 13."""
    if isinstance(cmd, wm.Generate):
        return [tokens(cmd.request_id, worker_id, (10,)),
                tokens(cmd.request_id, worker_id, tuple(range(11, 10 + cmd.sampling.max_tokens)), finished=True)]
    return happy_workers(worker_id, cmd)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir) -> RouterTokenizer:
    return RouterTokenizer(tiny_dir)


def journey(request_id: str = "r", deadline_s: float = 5.0, stop: tuple[str, ...] = (),
            client_id: str = "client-r") -> Journey:
    """`request_id` is the router's internal id (what the workers see), `client_id` the client's."""
    return Journey(request_id, client_id, PROMPT, SAMPLING, stop, time.monotonic() + deadline_s)


def run(pool: FakePool, tokenizer, settings: JourneySettings = SETTINGS, j: Journey | None = None,
        policy: str = "least_loaded", placer=None) -> list[pb.GenerateResponse]:
    """`placer(gate)`: the router's Placer for this run (default: adaptive, nothing counted)."""
    async def collect():
        gate = PrefillGate(settings.max_prefill_queue_tokens)
        return [r async for r in run_journey(j or journey(), pool, make_policy(policy), tokenizer, settings,
                                             gate=gate, placer=placer(gate) if placer else None)]

    return asyncio.run(asyncio.wait_for(collect(), 10))


def ids(responses: list[pb.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def test_disaggregated_happy_path_sends_each_command_once(tokenizer):
    pool = FakePool({"p0": "prefill", "d0": "decode"}, happy_workers)
    out = run(pool, tokenizer)
    assert ids(out) == [10, 11, 12, 13] and out[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert [type(m).__name__ for _, m in pool.sent] == ["ReserveKV", "Prefill"]  # protocol v2: no StartDecode
    [(worker, reserve)] = pool.commands(wm.ReserveKV)
    assert worker == "d0" and reserve.sampling == SAMPLING and reserve.prompt_token_ids == PROMPT
    assert not pool.commands(wm.Abort)  # a request that ended normally: the workers freed everything


def test_workers_see_only_the_internal_id_and_the_client_only_its_own(tokenizer):
    """The client's id is echoed and never sent to a worker; workers, the events mapped back to
    the journey and the aborts all go by the router's internal id."""
    pool = FakePool({"p0": "prefill", "d0": "decode"}, happy_workers)
    out = run(pool, tokenizer, j=journey("internal-7f3a", client_id="my-client-id"))
    assert ids(out) == [10, 11, 12, 13] and {r.request_id for r in out} == {"my-client-id"}
    assert {m.request_id for _, m in pool.sent} == {"internal-7f3a"}

    def silent_decode(worker_id, cmd):  # the first token comes, then nothing: the deadline ends it
        return happy_workers(worker_id, cmd)[:2] if isinstance(cmd, wm.Prefill) else happy_workers(worker_id, cmd)

    pool = FakePool({"p0": "prefill", "d0": "decode"}, silent_decode)
    with pytest.raises(RouterError):
        run(pool, tokenizer, j=journey("internal-9b", client_id="my-client-id", deadline_s=0.3))
    assert [(w, m.request_id) for w, m in pool.commands(wm.Abort)] == [("d0", "internal-9b")]


def test_decode_tokens_that_overtake_the_first_token_are_held_back(tokenizer):
    def overtaking(worker_id, cmd):
        events = happy_workers(worker_id, cmd)
        return events[::-1] if isinstance(cmd, wm.Prefill) else events  # decode's Tokens read first

    out = run(FakePool({"p0": "prefill", "d0": "decode"}, overtaking), tokenizer)
    assert ids(out) == [10, 11, 12, 13]


def test_full_decode_workers_are_retried_until_one_reserves(tokenizer):
    answers = iter([False, False, True])

    def busy_then_free(worker_id, cmd):
        if isinstance(cmd, wm.ReserveKV) and not next(answers):
            return [wm.ReserveRejected(cmd.request_id, worker_id, "no free KV pages")]
        return happy_workers(worker_id, cmd)

    pool = FakePool({"p0": "prefill", "d0": "decode"}, busy_then_free)
    assert ids(run(pool, tokenizer)) == [10, 11, 12, 13]
    assert len(pool.commands(wm.ReserveKV)) == 3 and len(pool.commands(wm.Prefill)) == 1


def test_a_failed_transfer_retries_with_the_tokens_the_client_has(tokenizer):
    def lose_first_attempt(worker_id, cmd):
        if isinstance(cmd, wm.Prefill) and not cmd.request_id.endswith(".retry1"):
            rid = cmd.request_id
            return [wm.FirstToken(rid, worker_id, 10, None, 0),
                    wm.Failed(rid, "d0", "transfer", "KV transfer aborted: prefill worker died")]
        if isinstance(cmd, wm.Prefill):  # the retry: the prompt now ends with the first token
            rid, rest = cmd.request_id, cmd.sampling.max_tokens
            return [wm.FirstToken(rid, worker_id, 11, None, 0), tokens(rid, "d0", tuple(range(12, 11 + rest)), True)]
        return happy_workers(worker_id, cmd)

    pool = FakePool({"p0": "prefill", "d0": "decode"}, lose_first_attempt)
    assert ids(run(pool, tokenizer)) == [10, 11, 12, 13]
    [first, retry] = [m for _, m in pool.commands(wm.Prefill)]
    assert (first.request_id, retry.request_id) == ("r", "r.retry1")
    assert retry.prompt_token_ids == (*PROMPT, 10) and retry.sampling.max_tokens == 3
    assert {w for w, m in pool.commands(wm.Abort) if m.request_id == "r"} == {"p0", "d0"}  # the lost attempt freed


def test_every_attempt_lost_is_unavailable_naming_the_losses(tokenizer):
    def always_lost(worker_id, cmd):
        if isinstance(cmd, wm.Prefill):
            return [wm.Failed(cmd.request_id, "d0", "transfer", "KV transfer expired: deadline passed")]
        return happy_workers(worker_id, cmd)

    with pytest.raises(RouterError) as err:
        run(FakePool({"p0": "prefill", "d0": "decode"}, always_lost), tokenizer)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "gave up after 3 attempts" in str(err.value) and "expired" in str(err.value)


def test_a_reserve_refused_for_good_is_invalid_argument_and_nothing_is_prefilled(tokenizer):
    def too_big(worker_id, cmd):
        if isinstance(cmd, wm.ReserveKV):
            return [wm.Failed(cmd.request_id, worker_id, "reserve", "needs more KV pages than this cache has")]
        return []

    pool = FakePool({"p0": "prefill", "d0": "decode"}, too_big)
    with pytest.raises(RouterError) as err:
        run(pool, tokenizer)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "more KV pages" in str(err.value)
    assert not pool.commands(wm.Prefill)


def test_the_deadline_ends_the_request_and_aborts_every_worker_involved(tokenizer):
    def prefill_never_answers(worker_id, cmd):
        return [] if isinstance(cmd, wm.Prefill) else happy_workers(worker_id, cmd)

    pool = FakePool({"p0": "prefill", "d0": "decode"}, prefill_never_answers)
    with pytest.raises(RouterError) as err:
        run(pool, tokenizer, j=journey(deadline_s=0.2))
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert sorted(w for w, _ in pool.commands(wm.Abort)) == ["d0", "p0"]
    assert all(not ids for ids in pool.involved.values())  # released in the pool's books too


def test_a_worker_that_stops_beating_loses_the_attempt_fast(tokenizer):
    pool = FakePool({"p0": "prefill", "d0": "decode", "d1": "decode"}, lambda w, c: [])

    def decode_dies(worker_id, cmd):
        if isinstance(cmd, wm.Prefill) and cmd.request_id == "r":
            pool.dead.add("d0")  # d0 took the reservation, then went silent
            return []
        return happy_workers(worker_id, cmd)

    pool.script = decode_dies
    start = time.monotonic()
    assert ids(run(pool, tokenizer)) == [10, 11, 12, 13]
    assert time.monotonic() - start < 2  # noticed by health, not by the 5 s deadline
    assert [w for w, m in pool.commands(wm.ReserveKV)] == ["d0", "d1"]


def test_colocated_is_one_generate(tokenizer):
    def colocated(worker_id, cmd):
        return [tokens(cmd.request_id, worker_id, (10, 11)), tokens(cmd.request_id, worker_id, (12, 13), True)]

    settings = JourneySettings(mode="colocated", kv_timeout_s=5.0, lease_s=5.0)
    pool = FakePool({"c0": "colocated"}, colocated)
    assert ids(run(pool, tokenizer, settings)) == [10, 11, 12, 13]
    assert [type(m).__name__ for _, m in pool.sent] == ["Generate"]


def test_a_stop_string_ends_the_stream_and_frees_the_workers(tokenizer):
    text = tokenizer.decode([10, 11])
    pool = FakePool({"p0": "prefill", "d0": "decode"}, happy_workers)
    out = run(pool, tokenizer, j=journey(stop=(text,)))
    assert out[-1].finish_reason == pb.FINISH_REASON_STOP and text not in "".join(r.text for r in out)
    # The prefill worker reported its transfer done (it holds nothing); the decode worker is told.
    assert [w for w, _ in pool.commands(wm.Abort)] == ["d0"]


def test_events_from_workers_the_attempt_did_not_ask_are_dropped(tokenizer):
    """Anyone who can reach the event socket can name a request id; a token or failure from a
    worker the attempt did not use never reaches the client."""
    def forger_first(worker_id, cmd):
        forged = []
        if isinstance(cmd, wm.ReserveKV):
            forged = [wm.Reserved(cmd.request_id, "d9", "kv:9", 1, 0)]
        if isinstance(cmd, wm.Prefill):
            rid = cmd.request_id
            forged = [wm.FirstToken(rid, "p9", 99, None, 0), tokens(rid, "p0", (98,)),
                      wm.Failed(rid, "d9", "transfer", "forged"), tokens(rid, "d9", (97,), True)]
        return forged + happy_workers(worker_id, cmd)

    pool = FakePool({"p0": "prefill", "d0": "decode"}, forger_first)
    assert ids(run(pool, tokenizer)) == [10, 11, 12, 13]
    [(worker, prefill)] = pool.commands(wm.Prefill)
    assert prefill.kv.address == "kv:1"  # the real reservation's address, not the forged one


@pytest.mark.parametrize("named", ["kv:2", "evil.example:9", ""])
def test_a_reservation_naming_another_kv_address_fails_before_any_prefill(tokenizer, named):
    """The decode worker the attempt asked reserves pages but names a KV address other than the one
    the cluster started it with: the prompt's KV would go there. The attempt fails, saying so, with
    no Prefill sent; the reservation is aborted and the refusal counted."""
    def elsewhere(worker_id, cmd):
        if isinstance(cmd, wm.ReserveKV):
            return [wm.Reserved(cmd.request_id, worker_id, named, 1, 0)]
        return happy_workers(worker_id, cmd)

    pool = FakePool({"p0": "prefill", "d0": "decode"}, elsewhere)
    with pytest.raises(RouterError) as err:
        run(pool, tokenizer)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert f"decode worker d0 reserved pages at KV address {named!r}, not at its known KV endpoint 'kv:1'" in str(err.value)
    assert not pool.commands(wm.Prefill)
    assert [w for w, _ in pool.commands(wm.Abort)] == ["d0"]  # its reserved pages are freed
    [(reason, detail)] = pool.rejected
    assert reason == "kv_address" and detail.startswith("request r: decode worker d0")
    assert all(not ids for ids in pool.involved.values())


def test_a_stop_string_inside_a_speculative_run_cuts_the_run_there(tokenizer):
    """Speculative decoding sends accepted runs as one Tokens message: the tokens after the one
    completing a stop string are neither sent nor counted, as when tokens come one by one; the
    worker's speculative totals reach the usage."""
    stop = tokenizer.decode([12])

    def colocated(worker_id, cmd):
        rid = cmd.request_id
        return [wm.Tokens(rid, worker_id, (10,), (), False, None),
                wm.Tokens(rid, worker_id, (11, 12, 13, 14), (), False, None, 0, 4, 3),
                wm.Tokens(rid, worker_id, (15,), (), True, "length", 0, 4, 3)]

    settings = JourneySettings(mode="colocated", kv_timeout_s=5.0, lease_s=5.0)
    out = run(FakePool({"c0": "colocated"}, colocated), tokenizer, settings, j=journey(stop=(stop,)))
    assert ids(out) == [10, 11, 12]
    assert out[-1].finish_reason == pb.FINISH_REASON_STOP
    assert out[-1].usage.completion_tokens == 3
    assert (out[-1].usage.spec_proposed_tokens, out[-1].usage.spec_accepted_tokens) == (4, 3)
    assert "".join(r.text for r in out) == tokenizer.decode([10, 11])


def test_a_pair_whose_kv_link_is_down_sends_its_kv_to_the_fallback(tokenizer):
    pool = FakePool({"p0": "prefill", "d0": "decode"}, happy_workers)
    pool.down_links.add(("p0", "d0"))
    pool.fallbacks["d0"] = "kv-zmq:1"
    assert ids(run(pool, tokenizer)) == [10, 11, 12, 13]
    [(_, prefill)] = pool.commands(wm.Prefill)
    assert prefill.kv.address == "kv-zmq:1"


def test_a_decode_worker_no_prefill_worker_can_reach_is_not_reserved(tokenizer):
    pool = FakePool({"p0": "prefill", "d0": "decode", "d1": "decode"}, happy_workers)
    pool.down_links.add(("p0", "d0"))  # and no fallback
    assert ids(run(pool, tokenizer)) == [10, 11, 12, 13]
    assert [w for w, _ in pool.commands(wm.ReserveKV)] == ["d1"]
    # No decode worker reachable from the only prefill worker: the prompt is computed on the decode worker.
    pool = FakePool({"p0": "prefill", "d0": "decode"}, whole_on_decode)
    pool.down_links.add(("p0", "d0"))
    placed: list[Placement] = []
    assert ids(run(pool, tokenizer, placer=lambda gate: Placer(PlacementSettings(), gate,
                                                               lambda rid, client_id, p: placed.append(p)))) == [10, 11, 12, 13]
    assert not pool.commands(wm.ReserveKV) and [w for w, _ in pool.commands(wm.Generate)] == ["d0"]
    assert [(p.kind, p.reason, p.decode) for p in placed] == [("local", "kv_link_down", "d0")]


def test_kv_the_prefill_worker_could_not_send_is_retried_at_once_marking_the_link(tokenizer):
    """TransferEnded(aborted): the prefill worker's link failed. The attempt is retried now (not
    when the decode worker's lease runs out, as its abort frame may never arrive) and the link
    is marked, so the retry does not take it again before a heartbeat says how it is."""
    def link_dies_once(worker_id, cmd):
        if isinstance(cmd, wm.Prefill) and not cmd.request_id.endswith(".retry1"):
            return [wm.FirstToken(cmd.request_id, worker_id, 10, None, 0),
                    wm.TransferEnded(cmd.request_id, worker_id, "aborted")]
        if isinstance(cmd, wm.Prefill):
            rid, rest = cmd.request_id, cmd.sampling.max_tokens
            return [wm.FirstToken(rid, worker_id, 11, None, 0), tokens(rid, "d0", tuple(range(12, 11 + rest)), True)]
        return happy_workers(worker_id, cmd)

    pool = FakePool({"p0": "prefill", "d0": "decode"}, link_dies_once)
    start = time.monotonic()
    assert ids(run(pool, tokenizer)) == [10, 11, 12, 13]
    assert time.monotonic() - start < 2  # not the 5 s lease
    assert pool.suspected == [("p0", "kv:1")]
    assert {w for w, m in pool.commands(wm.Abort) if m.request_id == "r"} == {"p0", "d0"}


def test_a_prompt_queued_for_a_prefill_worker_that_dies_is_computed_on_a_decode_worker(tokenizer):
    """Placed remote while p0 was up, it waits in the router's queue (p0 has no room); p0 dies.
    The prompt must move to the decode worker (placement 'local', no_prefill_worker), not fail
    UNAVAILABLE 'no healthy prefill worker' at the head of the queue (the cancel storm found it)."""
    pool = FakePool({"p0": "prefill", "d0": "decode"}, whole_on_decode)
    placed: list[Placement] = []

    async def scenario():
        gate = PrefillGate(64)
        gate._outstanding.add("p0", 64)  # another prompt fills p0's credit: ours waits
        placer = Placer(PlacementSettings("always"), gate, lambda rid, client_id, p: placed.append(p))

        async def kill_p0():
            await asyncio.sleep(0.2)
            pool.dead.add("p0")

        killer = asyncio.ensure_future(kill_p0())
        out = [r async for r in run_journey(journey(), pool, make_policy("least_loaded"), tokenizer, SETTINGS,
                                            gate=gate, placer=placer)]
        await killer
        return out

    assert ids(asyncio.run(asyncio.wait_for(scenario(), 10))) == [10, 11, 12, 13]
    assert [(p.kind, p.reason, p.decode) for p in placed] == [("local", "no_prefill_worker", "d0")]
    assert not pool.commands(wm.Prefill) and [w for w, _ in pool.commands(wm.Generate)] == ["d0"]
