"""The flight recorder's ring, its dump file and triggers (proto/flight/): bounded, oldest out
first, a dump read back gives the messages recorded (a refused one marked undecodable), an
overdue request is named once, and SIGUSR1 writes every live ring."""

from __future__ import annotations

import os
import signal

import pytest

from proto import worker_messages as wm
from proto.flight.dump import FORMAT, find, read, render, write
from proto.flight.overrun import DeadlineWatch
from proto.flight.recorder import IN, OUT, FlightRecorder
from proto.flight.signals import install_sigusr1


def test_the_ring_keeps_the_newest_entries_up_to_its_capacity():
    r = FlightRecorder("decode", "decode-0", capacity=16)
    for i in range(40):
        r.message(IN, "router", f"r{i % 4}", wm.encode(wm.Abort(f"r{i % 4}")))
    assert len(r) == 16
    kept = r.entries()
    assert [e.request_id for e in kept[:4]] == ["r0", "r1", "r2", "r3"]  # 24..27: the 16 newest
    assert all(e.request_id == "r1" for e in r.entries("r1")) and len(r.entries("r1")) == 4
    r.state("joined", None, {})  # a state change naming no request is not kept
    assert len(r.entries()) == 16
    with pytest.raises(ValueError, match="at least 1"):
        FlightRecorder("router", capacity=0)


def test_a_dump_reads_back_as_the_messages_and_states_recorded(tmp_path):
    r = FlightRecorder("prefill", "prefill-0", header={"engine": {"model": "builtin:tiny"}})
    r.message(IN, "router", "a", wm.encode(wm.Abort("a")))
    r.message(OUT, "router", "a", wm.encode(wm.TransferEnded("a", "prefill-0", "aborted")))
    r.state("aborted", "a", {"why": "client"})
    r.message(IN, "router", "b", b"\x81\xa4type\xa5Bogus")  # a command the worker refused
    path = write(r, tmp_path / "dumps", "a test")
    assert path.name.startswith("prefill-0-") and path.name.endswith("-a-test.flight.jsonl")
    dump = read(path)
    assert dump.head["format"] == FORMAT and dump.head["reason"] == "a test" and dump.name == "prefill-0"
    assert dump.head["header"] == {"engine": {"model": "builtin:tiny"}}
    assert [m for _, m in dump.messages()] == [wm.Abort("a"), wm.TransferEnded("a", "prefill-0", "aborted")]
    assert dump.entries[2]["event"] == "aborted" and dump.entries[2]["fields"] == {"why": "client"}
    assert "undecodable" in dump.entries[3]["message"]
    assert find(tmp_path / "dumps") == [path]
    assert render(r, "x", request_id="b").count("\n") == 2  # header + b's one entry


def test_a_file_that_is_no_dump_is_refused_with_its_line(tmp_path):
    bad = tmp_path / "x.flight.jsonl"
    bad.write_text('{"format": "other"}\n')
    with pytest.raises(ValueError, match="not a flight recorder dump"):
        read(bad)
    bad.write_text('{"format": "pdserve-flight/1"}\nnot json\n')
    with pytest.raises(ValueError, match=r"x.flight.jsonl:2: not JSON"):
        read(bad)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.flight.jsonl files"):
        find(tmp_path / "empty")


def test_an_overdue_request_is_named_once_and_an_ended_one_never():
    now = [100.0]
    watch = DeadlineWatch(grace_s=5.0, clock=lambda: now[0])
    watch.start("late", 101.0)
    watch.start("done", 101.0)
    watch.start("fine", 200.0)
    watch.end("done")
    now[0] = 105.5
    assert watch.overdue() == []  # within the grace
    now[0] = 107.0
    assert watch.overdue() == [("late", 6.0)]
    assert watch.overdue() == []  # named once
    watch.end("late")
    assert len(watch) == 1


def test_sigusr1_dumps_every_live_recorder(tmp_path):
    r = FlightRecorder("decode", "decode-7")
    r.message(IN, "router", "z", wm.encode(wm.Abort("z")))
    before = signal.getsignal(signal.SIGUSR1)
    try:
        assert install_sigusr1(tmp_path)
        os.kill(os.getpid(), signal.SIGUSR1)
        dumps = [read(p) for p in find(tmp_path)]
    finally:
        signal.signal(signal.SIGUSR1, before)
    mine = [d for d in dumps if d.name == "decode-7"]
    assert len(mine) == 1 and mine[0].head["reason"] == "SIGUSR1"
    assert [m for _, m in mine[0].messages()] == [wm.Abort("z")]
