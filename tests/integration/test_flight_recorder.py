"""The flight recorder served end to end (proto/flight/, cluster/flight_replay.py): after a
mix of finished, cancelled and seeded-sampled requests on an in-process 1P1D cluster, each
process's dump holds its request's messages and `pdserve replay` re-drives the prefill and
decode dumps into twins that end every request as recorded (greedy tokens equal); a colocated
dump replays too; a request held past its deadline makes the router dump its ring."""

from __future__ import annotations

import time

import pytest

from cluster.cli import main as pdserve
from cluster.flight_replay import replay
from configs import EngineConfig
from proto import pdserve_pb2 as pb
from proto import worker_messages as wm
from proto.flight.dump import find, read
from tests.helpers import hf_greedy
from tests.local_cluster import LocalCluster

pytestmark = pytest.mark.cluster

ENGINE = EngineConfig(model="builtin:tiny", page_size=8, max_num_batched_tokens=64, max_num_seqs=16)
PROMPTS = [[0, 5, 6, 7], list(range(10, 60)), list(range(3, 30)), [9] * 17, list(range(40, 52))]


def serve_mix(cluster: LocalCluster) -> dict[tuple[int, ...], list[int]]:
    """Greedy requests to the end, two cancelled after their second token, one seeded-sampled;
    returns the finished greedy ones' tokens by prompt."""
    finished = {}
    for prompt in PROMPTS:
        ids = []
        for resp in cluster.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
                max_tokens=8, ignore_eos=True)), timeout=60):
            ids += resp.token_ids
        finished[tuple(prompt)] = ids
    for prompt in PROMPTS[:2]:
        call = cluster.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
            max_tokens=40, ignore_eos=True)), timeout=60)
        got = 0
        for resp in call:
            got += len(resp.token_ids)
            if got >= 2:
                call.cancel()
                break
    list(cluster.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPTS[2]), sampling=pb.SamplingParams(
        max_tokens=8, temperature=0.9, seed=7, ignore_eos=True)), timeout=60))
    cluster.wait_pages_free()
    return finished


def write_dumps(cluster: LocalCluster, out) -> None:
    out.mkdir()
    (out / "router.flight.jsonl").write_text(cluster.router.flight_dump("test"))
    for host in cluster.hosts:
        (out / f"{host.worker_id}.flight.jsonl").write_text(host.flight_dump("test"))


def test_disaggregated_dumps_replay_to_the_same_ends(tiny_dir, hf_tiny, tmp_path, capsys):
    c = LocalCluster(tiny_dir, "disaggregated", ENGINE, disaggregation="always")
    try:
        finished = serve_mix(c)
        time.sleep(0.3)  # the cancelled requests' last events reach the router
        write_dumps(c, tmp_path / "dumps")
    finally:
        c.close()
    for prompt, ids in finished.items():
        assert ids == hf_greedy(hf_tiny, list(prompt), 8)[0]
    dumps = {d.name: d for d in map(read, find(tmp_path / "dumps"))}
    assert set(dumps) == {"router", "prefill-0", "decode-0"}
    # The router's ring: each request's commands out, its events in, its state changes.
    router = dumps["router"]
    kinds = {(e["kind"], (e.get("message") or {}).get("type") or e.get("event")) for e in router.entries}
    assert {("out", "ReserveKV"), ("in", "Reserved"), ("out", "Prefill"), ("in", "FirstToken"), ("in", "Tokens"),
            ("out", "Abort"), ("state", "admitted"), ("state", "finished")} <= kinds
    ends = sorted(str(r.recorded) for r in replay(router).requests)  # summarised as the router saw them
    assert ends == ["failed (CANCELLED)"] * 2 + ["finished (length)"] * 6, ends
    # Every worker dump replays to the same ends, with 8 requests each.
    for name in ("prefill-0", "decode-0"):
        report = replay(dumps[name])
        assert len(report.requests) == 8, list(report.lines())
        verdicts = [r.verdict for r in report.requests]
        assert verdicts == ["same"] * 8, "\n".join(report.lines())
        states = sorted(r.recorded.state for r in report.requests)
        assert states == (["sent"] * 8 if name == "prefill-0" else ["aborted"] * 2 + ["finished"] * 6), states
    decode = replay(dumps["decode-0"])
    greedy = [r for r in decode.requests if r.recorded.state == "finished" and r.tokens_compared]
    assert len(greedy) == 6  # the seeded one compares tokens too
    # The CLI says the same, exit 0; a dump whose tokens were changed replays DIFFERENT, exit 1.
    assert pdserve(["replay", str(tmp_path / "dumps")]) == 0
    assert "8 same" in capsys.readouterr().out
    lines = (tmp_path / "dumps" / "decode-0.flight.jsonl").read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if '"finished": true' in line)
    lines[i] = lines[i].replace('"token_ids": [', '"token_ids": [1, ', 1)
    (tmp_path / "dumps" / "decode-0.flight.jsonl").write_text("\n".join(lines) + "\n")
    assert pdserve(["replay", str(tmp_path / "dumps" / "decode-0.flight.jsonl")]) == 1
    assert "DIFFERENT" in capsys.readouterr().out


def test_a_colocated_dump_replays_to_the_same_ends(tiny_dir, tmp_path):
    c = LocalCluster(tiny_dir, "colocated", ENGINE)
    try:
        serve_mix(c)
        time.sleep(0.3)
        write_dumps(c, tmp_path / "dumps")
    finally:
        c.close()
    report = replay(read(tmp_path / "dumps" / "colocated-0.flight.jsonl"))
    assert [r.verdict for r in report.requests] == ["same"] * 8, "\n".join(report.lines())


def test_a_request_held_past_its_deadline_dumps_the_routers_ring(tiny_dir, tmp_path):
    c = LocalCluster(tiny_dir, "colocated", ENGINE, flight={"dump_dir": str(tmp_path), "overrun_grace_s": 0.5})
    try:
        list(c.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling=pb.SamplingParams(
            max_tokens=2)), timeout=60))
        assert list(tmp_path.iterdir()) == []  # requests that end in time dump nothing
        # A request the router still holds 10 s past its deadline (what a hang looks like).
        c.loop.call_soon_threadsafe(c.router.overdue.start, "r-hung", time.monotonic() - 10)
        deadline = time.monotonic() + 5
        while not list(tmp_path.glob("router-*overrun-r-hung*.flight.jsonl")) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        c.close()
    [path] = tmp_path.glob("router-*overrun-r-hung*.flight.jsonl")
    dump = read(path)
    assert dump.head["reason"] == "overrun r-hung"
    assert any(isinstance(m, wm.Generate) for _, m in dump.messages())  # the ring as it was: the earlier request


def test_a_decode_dump_replays_to_the_same_ends_after_its_prefill_worker_died(tiny_dir, hf_tiny, tmp_path):
    """The only prefill worker crashes at its third first token: that request's reservation on
    decode ends without KV and the router computes its prompt (and the later ones) on the decode
    worker. The decode twin, fed the record, ends every request the same way."""
    first_tokens = []

    def crash_at_third(message: object) -> str | None:
        if isinstance(message, wm.FirstToken):
            first_tokens.append(message.request_id)
            return "before" if len(first_tokens) == 3 else None
        return None

    c = LocalCluster(tiny_dir, "disaggregated", ENGINE, disaggregation="always", crash_when={"prefill-0": crash_at_third},
                     heartbeat_timeout_s=1.0)
    try:
        for prompt in PROMPTS:
            ids = []
            for resp in c.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
                    max_tokens=8, ignore_eos=True)), timeout=60):
                ids += resp.token_ids
            assert ids == hf_greedy(hf_tiny, prompt, 8)[0]
        c.wait_pages_free()
        time.sleep(0.3)
        decode = next(h for h in c.hosts if h.role == "decode")
        (tmp_path / "decode-0.flight.jsonl").write_text(decode.flight_dump("test"))
    finally:
        c.close()
    dump = read(tmp_path / "decode-0.flight.jsonl")
    commands = [type(m).__name__ for e, m in dump.messages() if e["kind"] == "in"]
    assert "Generate" in commands and commands.count("ReserveKV") >= 3, commands
    report = replay(dump)
    assert report.requests and all(r.verdict == "same" for r in report.requests), "\n".join(report.lines())
    ends = sorted(r.recorded.state for r in report.requests)
    assert ends == ["aborted"] + ["finished"] * len(PROMPTS), ends  # the crashed one's reservation, then its retry


def test_a_recorded_kv_transfer_failure_fails_the_twins_reservation_too(tmp_path):
    """A decode worker's record where one reservation's KV never came (Failed at stage transfer)
    and another's did: the twin fails the first where the record says, and decodes the second."""
    from proto.flight.dump import write
    from proto.flight.recorder import IN, OUT, FlightRecorder

    rec = FlightRecorder("decode", "decode-0", header={"engine": ENGINE.model_dump(mode="json")})
    sampling = wm.Sampling(max_tokens=4, ignore_eos=True)
    for rid in ("lost", "kept"):
        rec.message(IN, "router", rid, wm.encode(wm.ReserveKV(rid, tuple(range(3, 20)), 30.0, sampling)))
        rec.message(OUT, "router", rid, wm.encode(wm.Reserved(rid, "decode-0", "x:1", 3, 0, "t")))
    rec.state("failed", "lost", {"stage": "transfer", "reason": "KV transfer expired"})
    rec.message(OUT, "router", "lost", wm.encode(wm.Failed("lost", "decode-0", "transfer", "KV transfer expired")))
    rec.state("transfer_received", "kept", {"first_token": 5})
    report = replay(read(write(rec, tmp_path, "test")))
    ends = {r.request_id: r for r in report.requests}
    assert ends["lost"].replayed == ends["lost"].recorded and str(ends["lost"].recorded) == "failed (transfer)"
    assert ends["lost"].verdict == "same"
    assert ends["kept"].verdict == "in flight when dumped" and ends["kept"].replayed.state == "finished"
