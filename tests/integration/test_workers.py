"""Prefill, decode and colocated workers driven in-process by a minimal router loop: the
message journey of proto/worker_messages.py with real engines and the in-process KV channel.
Outputs must equal Hugging Face greedy; aborts at every stage, a lapsed lease and a full
decode pool must each leave no page referenced on either worker."""

from __future__ import annotations

import time

import pytest

from configs import EngineConfig
from decode_worker.colocated import ColocatedWorker
from decode_worker.worker import DecodeWorker
from engine import LLMEngine
from engine.kv_transfer import BaseFrameSender
from engine.kv_transfer.destinations import KVDestinations
from engine.kv_transfer.inproc import InProcChannel
from engine.kv_transfer.links import KVLinks
from prefill_worker.worker import PrefillWorker
from proto import worker_messages as m
from tests.helpers import assert_no_page_leak, hf_greedy

GREEDY = m.Sampling(max_tokens=12, ignore_eos=True)


class MiniRouter:
    """Just enough of the router's journey to drive the workers (messages go through
    encode/decode, as on the socket)."""

    def __init__(self, prefill_budget: int = 32, decode_pages: int | None = None, model: str = "builtin:tiny",
                 decode_speculative: dict | None = None, sampling: m.Sampling = GREEDY) -> None:
        self.channel = InProcChannel()
        self.sampling = sampling
        self.to_router: list[object] = []
        emit = lambda msg: self.to_router.append(m.decode(m.encode(msg)))  # noqa: E731
        self.opened: list[str] = []  # KV destinations the prefill worker connected to
        self.prefill = PrefillWorker(
            "p0", LLMEngine(EngineConfig(model=model, page_size=8, max_num_batched_tokens=prefill_budget,
                                         max_num_seqs=8)),
            KVLinks(self._open_frames, checksum=True), emit, KVDestinations(["inproc"]), pages_per_frame=2)
        self.decode = DecodeWorker(
            "d0", LLMEngine(EngineConfig(model=model, page_size=8, num_pages=decode_pages,
                                         speculative=decode_speculative or {"method": "none"})),
            self.channel.receiver, "inproc", emit)
        self.prompts: dict[str, tuple[int, ...]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}
        self.failed: dict[str, m.Failed] = {}
        self.rejected: set[str] = set()
        self.stage: dict[str, str] = {}
        self.spec: dict[str, tuple[int, int]] = {}  # speculative (proposed, accepted) per request

    def _open_frames(self, address: str) -> BaseFrameSender:
        self.opened.append(address)
        return self.channel.sender

    def submit(self, request_id: str, prompt: list[int], lease_s: float = 10.0) -> None:
        self.prompts[request_id] = tuple(prompt)
        self.outputs[request_id] = []
        self.stage[request_id] = "reserving"
        self.decode.handle(m.decode(m.encode(m.ReserveKV(request_id, tuple(prompt), lease_s, self.sampling))))

    def abort(self, request_id: str) -> None:
        for worker in (self.prefill, self.decode):
            worker.handle(m.Abort(request_id))
        self.stage[request_id] = "aborted"

    def pump(self) -> None:
        for _ in self._half_steps():
            pass

    def _half_steps(self):
        """Each worker steps, then the router takes its messages: a test may act in between (the
        decode worker joins a request as soon as its KV lands, so "first token routed, decode not
        joined yet" exists only between the two)."""
        for worker in (self.prefill, self.decode):
            worker.step()
            while self.to_router:
                self.route(self.to_router.pop(0))
            yield

    def route(self, msg: object) -> None:
        rid = msg.request_id
        if self.stage.get(rid) == "aborted":
            return
        if isinstance(msg, m.Reserved):
            self.stage[rid] = "prefilling"
            kv = m.KVDestination(msg.kv_address, msg.num_pages, msg.num_cached_pages, timeout_s=10,
                                 token=msg.transfer_token)
            self.prefill.handle(m.Prefill(rid, self.prompts[rid], self.sampling, kv))
        elif isinstance(msg, m.ReserveRejected):
            self.rejected.add(rid)
        elif isinstance(msg, m.FirstToken):
            self.stage[rid] = "first_token"
            self.outputs[rid].append(msg.token_id)  # decode joins on its own when the KV lands
        elif isinstance(msg, m.TransferEnded):
            assert msg.state == "done", msg
        elif isinstance(msg, m.Tokens):
            self.stage[rid] = "decoding"
            self.outputs[rid] += msg.token_ids
            self.spec[rid] = (msg.spec_proposed_tokens, msg.spec_accepted_tokens)
            if msg.finished:
                self.finished[rid] = msg.finish_reason
        elif isinstance(msg, m.Failed):
            self.failed[rid] = msg

    def run(self, until, max_pumps: int = 2000) -> None:
        if until():
            return
        for _ in range(max_pumps):
            for _ in self._half_steps():
                if until():
                    return
        raise AssertionError("router loop did not converge")

    def assert_clean(self) -> None:
        for engine in (self.prefill.engine, self.decode.engine):
            engine.page_manager.reset_prefix_cache()
            assert_no_page_leak(engine)
        assert self.decode.receiver.num_pending == 0 and not self.prefill._jobs


def test_disaggregated_journey_matches_hf(hf_tiny):
    router = MiniRouter()
    base = [0] + list(range(300, 370))
    prompts = {"long": base, "shares-prefix": base[:40] + [9, 8, 7], "short": [0, 42, 43], "mid": list(range(3, 30))}
    router.submit("long", prompts["long"])
    router.run(lambda: router.stage["long"] == "decoding")  # its pages are now cached on decode
    for rid in ("shares-prefix", "short", "mid"):
        router.submit(rid, prompts[rid])
        router.pump()  # staggered arrivals, joining a batch that is decoding
    router.run(lambda: len(router.finished) == len(prompts))
    for rid, prompt in prompts.items():
        assert router.outputs[rid] == hf_greedy(hf_tiny, prompt, GREEDY.max_tokens)[0], rid
        assert router.finished[rid] == "length"
    assert router.decode.engine.page_manager.prefix_hit_tokens >= 40  # "shares-prefix" got 5 pages free
    router.assert_clean()


@pytest.mark.parametrize("method", ["prompt_lookup", "draft", "medusa"])
def test_disaggregated_decode_with_speculation_matches_hf(loopy_dir, hf_loopy, loopy_draft_dir, lm_head_heads_dir,
                                                          method):
    """1P1D with speculation on the decode worker only (builtin:tiny made repetitive, so proposals
    are right and wrong; a draft model's prompt KV is computed on the decode worker itself; Medusa
    heads start on the decode worker's first step of its own): the stream is HF greedy's, token for
    token, and a draft's pages and Medusa's hidden rows are all gone at the end."""
    sampling = m.Sampling(max_tokens=40, ignore_eos=True)
    speculative = ({"method": method, "cost_policy": False}  # (the cost policy decides by the wall clock)
                   | {"draft": {"draft_model": str(loopy_draft_dir)},
                      "medusa": {"medusa_heads": str(lm_head_heads_dir)}}.get(method, {}))
    router = MiniRouter(model=str(loopy_dir), decode_speculative=speculative, sampling=sampling)
    prompts = {f"r{i}": [0] + [(i * 7919 + j * 104729) % 3997 + 3 for j in range(20 + 5 * i)] for i in range(3)}
    draft = router.decode.engine.speculator.proposers.get("draft")
    prompt_catch_ups = []  # per draft proposal: whether it computed prompt KV inside a decode step
    if draft is not None:
        propose = draft.propose

        def recording_propose(seqs, max_num_tokens):
            proposals = propose(seqs, max_num_tokens)
            prompt_catch_ups.append(draft.computed_prompt)
            return proposals

        draft.propose = recording_propose
    ahead: dict[str, bool] = {}  # whether the draft's prompt KV was computed before the KV arrived
    for rid, prompt in prompts.items():
        busy = router.decode.engine.has_unfinished_requests()
        router.submit(rid, prompt)
        if draft is not None:  # reserved, its KV not yet sent: an idle decode worker computes the draft's prompt KV
            router.decode.step()
            assert router.stage[rid] == "reserving"
            twin = draft.twins.get(rid)  # type: ignore[attr-defined]
            ahead[rid] = twin is not None and twin.seq.num_computed_tokens == len(prompt)
            assert ahead[rid] != busy  # a busy worker's steps never wait for it
        router.pump()
    router.run(lambda: len(router.finished) == len(prompts))
    if draft is not None:
        assert ahead["r0"] and not all(ahead.values())
        # Only the requests that joined a running batch computed their prompt in a decode step.
        assert sum(prompt_catch_ups) == sum(not a for a in ahead.values())
    for rid, prompt in prompts.items():
        assert router.outputs[rid] == hf_greedy(hf_loopy, prompt, sampling.max_tokens)[0], rid
    assert sum(a for _, a in router.spec.values()) > 0
    assert sum(p - a for p, a in router.spec.values()) > 0
    if method == "draft":
        draft = router.decode.engine.speculator.proposers["draft"]
        assert not draft.twins and draft.page_manager.num_referenced_pages == 0  # type: ignore[attr-defined]
    if method == "medusa":
        assert not router.decode.engine.speculator.proposers["medusa"].hidden  # type: ignore[attr-defined]
    router.assert_clean()


def test_a_draft_prompt_computed_ahead_is_freed_when_its_request_never_joins(loopy_dir, loopy_draft_dir):
    """The decode worker computes a reserved request's draft prompt KV while its KV is on the
    way; an abort before the transfer and a lease that runs out each free those draft pages."""
    speculative = {"method": "draft", "draft_model": str(loopy_draft_dir), "cost_policy": False}
    router = MiniRouter(model=str(loopy_dir), decode_speculative=speculative)
    draft = router.decode.engine.speculator.proposers["draft"]
    # The leases run on a clock of the test's: on a loaded machine the two steps below may take
    # longer than the short lease, which would lapse before its prompt was computed ahead.
    now = [0.0]
    router.decode.receiver.clock = lambda: now[0]
    router.decode.handle(m.ReserveKV("aborted", tuple(range(3, 40)), 10.0, GREEDY))
    router.decode.handle(m.ReserveKV("lapsed", tuple(range(5, 30)), 0.05, GREEDY))
    router.decode.step()
    router.decode.step()
    assert {rid: twin.seq.num_computed_tokens for rid, twin in draft.twins.items()} == {"aborted": 37, "lapsed": 25}
    router.decode.handle(m.Abort("aborted"))
    assert list(draft.twins) == ["lapsed"]
    now[0] = 0.1  # past the short lease
    router.to_router.clear()
    router.decode.step()
    [failed] = router.to_router
    assert failed.request_id == "lapsed" and "expired" in failed.reason
    assert not draft.twins and draft.page_manager.num_referenced_pages == 0
    assert not router.decode.engine.speculator._ahead
    router.assert_clean()


def test_a_reservation_with_bad_sampling_on_a_draft_worker_computes_nothing_ahead(loopy_dir, loopy_draft_dir):
    """Settings the join would refuse (a negative temperature, past the router's checks) are left
    for it to report: the reservation stands, no draft work is queued for it, nothing leaks."""
    speculative = {"method": "draft", "draft_model": str(loopy_draft_dir), "cost_policy": False}
    router = MiniRouter(model=str(loopy_dir), decode_speculative=speculative)
    bad = m.Sampling(max_tokens=8, temperature=-1.0)
    router.decode.handle(m.ReserveKV("bad", tuple(range(3, 30)), 10.0, bad))
    assert isinstance(router.to_router.pop(), m.Reserved)
    assert not router.decode.step()  # no draft prompt to compute, no KV, nothing running
    assert not router.decode.engine.speculator._ahead
    assert not router.decode.engine.speculator.proposers["draft"].twins  # type: ignore[attr-defined]
    router.decode.handle(m.Abort("bad"))
    router.assert_clean()


def test_colocated_worker_matches_hf(hf_tiny):
    out: list[m.Tokens] = []
    worker = ColocatedWorker("c0", LLMEngine(EngineConfig(model="builtin:tiny")), out.append)
    prompts = {"a": [0] + list(range(50, 90)), "b": [0, 7, 8]}
    for rid, prompt in prompts.items():
        worker.handle(m.Generate(rid, tuple(prompt), GREEDY))
    while worker.step():
        pass
    for rid, prompt in prompts.items():
        tokens = [t for msg in out if msg.request_id == rid for t in msg.token_ids]
        assert tokens == hf_greedy(hf_tiny, prompt, GREEDY.max_tokens)[0]
    assert_no_page_leak(worker.engine)


@pytest.mark.parametrize("stage", ["prefilling", "first_token", "decoding"])
def test_abort_at_each_stage_frees_both_workers(stage):
    router = MiniRouter(prefill_budget=16)
    router.submit("victim", [0] + list(range(100, 160)))
    router.submit("bystander", [0] + list(range(200, 220)))
    router.run(lambda: router.stage["victim"] == stage)
    router.abort("victim")
    router.run(lambda: "bystander" in router.finished)
    router.run(lambda: not router.prefill._jobs and router.decode.receiver.num_pending == 0)
    assert "victim" not in router.finished
    router.assert_clean()


def test_abort_while_reserved_and_lapsed_lease_and_full_pool():
    router = MiniRouter(decode_pages=12)  # 96 slots
    router.submit("held", [0] + list(range(10, 30)))  # reserved; the router aborts before prefill
    router.to_router.clear()
    router.abort("held")
    router.decode.handle(m.ReserveKV("lapsed", tuple(range(3, 20)), 0.05, GREEDY))
    assert isinstance(router.to_router.pop(), m.Reserved)  # ... and nobody ever prefills it
    time.sleep(0.1)
    router.decode.step()
    [failed] = router.to_router
    router.to_router.clear()
    assert failed.request_id == "lapsed" and failed.stage == "transfer" and "expired" in failed.reason
    router.submit("too-big", list(range(3, 100)))  # 97 tokens: more than the whole cache, ever
    router.pump()
    assert router.failed["too-big"].stage == "reserve"
    assert "needs more KV pages than this cache has" in router.failed["too-big"].reason
    router.submit("fits", list(range(3, 60)))
    router.submit("waits", list(range(3, 60)))  # 57 + 57 tokens do not fit at once: backpressure
    router.pump()
    assert router.rejected == {"waits"}
    router.run(lambda: "fits" in router.finished)
    router.assert_clean()


def test_a_lease_longer_than_configured_is_cut_to_it():
    """A ReserveKV asking to hold pages for 1e300 s holds them for max_lease_s: no peer can pin a
    decode worker's cache by asking."""
    router = MiniRouter()
    router.decode.max_lease_s = 0.05
    router.decode.handle(m.ReserveKV("greedy", tuple(range(3, 20)), 1e300, GREEDY))
    assert isinstance(router.to_router.pop(), m.Reserved)
    time.sleep(0.1)
    router.decode.step()
    [failed] = router.to_router
    assert failed.request_id == "greedy" and failed.stage == "transfer" and "expired" in failed.reason
    router.assert_clean()


def test_a_kv_destination_that_is_no_decode_endpoint_is_refused(hf_tiny):
    """A Prefill naming a KV destination the worker was never told of (a forged or buggy command)
    fails that request with the reason, before any page is taken or any connection opened; the
    worker counts it and serves the next request exactly as before."""
    router = MiniRouter()
    prompt = [0] + list(range(100, 140))
    router.decode.handle(m.ReserveKV("forged", tuple(prompt), 10.0, GREEDY))  # real pages on decode
    reserved = router.to_router.pop()
    assert isinstance(reserved, m.Reserved)
    kv = m.KVDestination("10.66.0.1:5555", reserved.num_pages, reserved.num_cached_pages, 10, reserved.transfer_token)
    router.prefill.handle(m.decode(m.encode(m.Prefill("forged", tuple(prompt), GREEDY, kv))))
    [failed] = router.to_router
    router.to_router.clear()
    assert failed.request_id == "forged" and failed.worker_id == "p0" and failed.stage == "prefill"
    assert failed.reason == ("KV destination '10.66.0.1:5555' is not a known decode endpoint of this cluster "
                             "(1 known)")
    assert router.prefill.rejected == {"unknown_kv_destination": 1}
    assert router.opened == [] and not router.prefill._jobs
    assert_no_page_leak(router.prefill.engine)
    assert not router.prefill.step()  # nothing was admitted
    router.decode.handle(m.Abort("forged"))  # what the router does on Failed: free every side
    router.submit("next", prompt)
    router.run(lambda: "next" in router.finished)
    assert router.outputs["next"] == hf_greedy(hf_tiny, prompt, GREEDY.max_tokens)[0]
    assert router.opened == ["inproc"]
    router.assert_clean()
