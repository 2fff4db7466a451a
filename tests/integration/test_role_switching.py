"""Role switching served end to end, in one process (router/role_switch/, cluster/role_switch/):
switchable workers on real ZMQ sockets and the router over gRPC. A decode worker flipped to
prefill under load (and back) fails no request, every reply is Hugging Face's greedy tokens, the
old role's work finishes where it was, the new role's work goes to the worker at once, and no
page or request id is left held. The controller flips on its own when prompts queue while the
decode side idles."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster.flight_replay import replay
from configs import EngineConfig
from proto import pdserve_pb2 as pb
from proto import worker_messages as wm
from proto.flight.dump import read as read_dump
from proto.flight.recorder import IN
from router.role_switch.flips import RoleFlipError
from tests.helpers import hf_greedy
from tests.local_cluster import LocalCluster

pytestmark = pytest.mark.cluster

ENGINE = EngineConfig(model="builtin:tiny", page_size=8, max_num_batched_tokens=64, max_num_seqs=16)


def generate(cluster: LocalCluster, prompt: list[int], max_tokens: int = 24) -> pb.GenerateResponse:
    return cluster.stub.GenerateUnary(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
        timeout=60)


def flip(cluster: LocalCluster, worker_id: str, role: str) -> dict:
    return asyncio.run_coroutine_threadsafe(cluster.router.set_role(worker_id, role, "test"), cluster.loop).result(10)


def host(cluster: LocalCluster, worker_id: str):
    return next(h for h in cluster.hosts if h.worker_id == worker_id)


def wait_for(condition, timeout_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_a_flip_under_load_fails_nothing_and_matches_hf(tiny_dir, hf_tiny, tmp_path):
    c = LocalCluster(tiny_dir, "disaggregated", ENGINE, num_workers={"prefill": 1, "decode": 2},
                     disaggregation="always", role_switching={"mode": "manual"})
    try:
        prompts = [[0] + [(7 * i + j) % 900 + 5 for j in range(20 + i % 9)] for i in range(24)]
        want = {i: hf_greedy(hf_tiny, p, 24)[0] for i, p in enumerate(prompts)}
        with ThreadPoolExecutor(12) as pool:
            first = [pool.submit(generate, c, p) for p in prompts[:12]]
            # decode-1 holds decoding sequences when it flips: they must finish there.
            wait_for(lambda: host(c, "decode-1").engine.snapshot.num_running > 0, what="decode-1 to decode")
            assert flip(c, "decode-1", "prefill") == {"worker_id": "decode-1", "old": "decode", "role": "prefill",
                                                      "reason": "test"}
            assert sorted(w.worker_id for w in c.router.pool.loads("prefill")) == ["decode-1", "prefill-0"]
            assert [w.worker_id for w in c.router.pool.loads("decode")] == ["decode-0"]
            second = [pool.submit(generate, c, p) for p in prompts[12:]]
            # And prefill-0 to decode while prompts are queued for it: the ones it was already
            # chosen for still reach it (served as late commands), the rest go to decode-1.
            wait_for(lambda: host(c, "prefill-0").engine.snapshot.num_waiting + host(c, "prefill-0").engine.snapshot
                     .num_running > 0, what="prefill-0 to compute")
            flip(c, "prefill-0", "decode")
            replies = [f.result() for f in first + second]
            third = [pool.submit(generate, c, p) for p in prompts[:6]]
            replies += [f.result() for f in third]
        assert sorted(w.worker_id for w in c.router.pool.loads("decode")) == ["decode-0", "prefill-0"]
        for i, reply in enumerate(replies):
            assert list(reply.token_ids) == want[i % 24], f"request {i} ({reply.usage.placement})"
        # The flipped worker now computes prompts and ships their KV: its heartbeat says so, and
        # the prompts sent after the flip went to either prefill worker, none to it as decode.
        assert host(c, "decode-1").current_role == "prefill"
        taken = [wm.decode(e.payload) for e in host(c, "decode-1").recorder.entries() if e.kind == IN]
        kinds = [type(m).__name__ for m in taken]
        at = kinds.index("SetRole")  # what it took before the flip was decode work, after it prefill work
        assert set(kinds[:at]) <= {"ReserveKV", "Abort"} and "ReserveKV" in kinds[:at]
        assert set(kinds[at + 1:]) <= {"Prefill", "Abort"} and "Prefill" in kinds[at + 1:], kinds
        # prefill-0's own record: what reached it after its flip for its old role was served and counted.
        kinds = [type(wm.decode(e.payload)).__name__ for e in host(c, "prefill-0").recorder.entries() if e.kind == IN]
        late = kinds[kinds.index("SetRole") + 1:].count("Prefill")
        assert host(c, "prefill-0").state()["late_commands"] == ({"Prefill": late} if late else {})
        wait_for(lambda: c.router.pool.loads("prefill")[0].queued_tokens == 0, what="decode-1's heartbeat")
        assert host(c, "decode-1").engine.snapshot.num_running == 0  # its decodes finished there
        # And back: it decodes again; requests still match.
        flip(c, "decode-1", "decode")
        for i in (0, 5, 11):
            assert list(generate(c, prompts[i]).token_ids) == want[i]
        view = {w["worker_id"]: w for w in c.router.pool.view()}
        assert view["decode-1"]["role"] == "decode" and view["decode-1"]["started_as"] == "decode"
        assert view["decode-1"]["last_flip"]["reason"] == "test" and view["decode-1"]["last_flip"]["by"] == "manual"
        flips = {s.labels["role"]: s.value for m in c.router.metrics.role_flips.collect() for s in m.samples
                 if s.name.endswith("_total")}
        assert flips == {"prefill": 1.0, "decode": 2.0}
        c.wait_pages_free()
        dump = tmp_path / "decode-1.flight.jsonl"  # a switchable worker's flight dump is written, not replayed yet
        dump.write_text(host(c, "decode-1").flight_dump())
        with pytest.raises(ValueError, match="switchable worker's .* not supported yet"):
            replay(read_dump(dump))
        held = c.held()
        assert not held["request_ids"] and not any(held["workers"].values()), held
    finally:
        c.close()


def test_flips_that_cannot_be_made_say_why(tiny_dir):
    c = LocalCluster(tiny_dir, "disaggregated", ENGINE, role_switching={"mode": "manual"})
    try:
        for worker, role, why in [("decode-0", "prefill", "the only healthy decode worker"),
                                  ("prefill-0", "prefill", "already serves prefill"),
                                  ("nope", "decode", "no worker 'nope'"),
                                  ("prefill-0", "colocated", "flips to one of")]:
            with pytest.raises(RoleFlipError, match=why):
                flip(c, worker, role)
        # The prefill pool may empty: decode workers compute prompts then (router/placement/).
        flip(c, "prefill-0", "decode")
        assert list(generate(c, [0, 5, 6, 7], 6).token_ids) == list(generate(c, [0, 5, 6, 7], 6).token_ids)
    finally:
        c.close()


def test_fixed_roles_refuse_a_flip(tiny_dir):
    c = LocalCluster(tiny_dir, "disaggregated", ENGINE)
    try:
        with pytest.raises(RoleFlipError, match="role switching is off"):
            flip(c, "prefill-0", "decode")
    finally:
        c.close()


def test_the_controller_flips_a_decode_worker_when_prompts_wait(tiny_dir, hf_tiny):
    """TTFT far past its target while TPOT is far under its own: one decode worker becomes a
    prefill worker on its own, once; every reply, before and after, is Hugging Face's."""
    c = LocalCluster(tiny_dir, "disaggregated", ENGINE, num_workers={"prefill": 1, "decode": 2},
                     disaggregation="always", slo_ttft_ms=1.0, slo_tpot_ms=60_000.0,
                     role_switching={"mode": "auto", "interval_s": 0.1, "min_samples": 4, "sustain_s": 0.3,
                                     "cooldown_s": 600.0})
    try:
        prompts = [[0] + [(11 * i + j) % 900 + 5 for j in range(40)] for i in range(16)]
        want = [hf_greedy(hf_tiny, p, 6)[0] for p in prompts]
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda p: generate(c, p, 6), prompts))
            wait_for(lambda: c.router.metrics.role_flips.labels("prefill", "controller")._value.get() == 1,
                     what="the controller's flip")
            replies += list(pool.map(lambda p: generate(c, p, 6), prompts))
        assert [list(r.token_ids) for r in replies] == want + want
        flipped = [w for w in c.router.pool.view() if w.get("last_flip")]
        assert len(flipped) == 1 and flipped[0]["role"] == "prefill" and flipped[0]["started_as"] == "decode"
        assert flipped[0]["last_flip"]["by"] == "controller"
        assert "prefill short of workers" in flipped[0]["last_flip"]["reason"]
        c.wait_pages_free()
    finally:
        c.close()
