"""cluster/serving_loop.py's EventSink: a step's events leave as one signed frame, one part each.

Real ZMQ sockets over loopback, the router's FrameVerifier on the receiving side; the router's
own pump (router/worker_pool.py) is exercised end to end by the integration tests.
"""

import pytest
import zmq

from cluster import serving_loop
from cluster.serving_loop import EventSink
from proto import worker_messages as wm
from proto.frame_auth import ClusterSecret, FrameVerifier

SECRET = ClusterSecret("event-sink-test-secret-0123456789")


@pytest.fixture()
def receiver():
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    address = f"127.0.0.1:{port}"
    verifier = FrameVerifier(SECRET, address)

    def frames(n: int) -> list[list[object]]:
        """The next n frames, each as its decoded events."""
        out = []
        for _ in range(n):
            assert sock.poll(5000), "no frame arrived"
            _, parts = verifier.verify(sock.recv_multipart())
            out.append([wm.decode(bytes(p)) for p in parts])
        assert not sock.poll(100), "more frames than expected"
        return out

    yield address, frames
    sock.close()


def tokens(rid: str, token: int) -> wm.Tokens:
    return wm.Tokens(rid, "decode-0", (token,), (), False, None)


def test_events_of_a_batch_leave_as_one_frame_and_others_one_each(receiver):
    address, frames = receiver
    sink = EventSink(address, SECRET, "decode-0")
    try:
        sink.emit(tokens("a", 1))
        with sink.batch():
            for i in range(5):
                sink.emit(tokens(f"r{i}", i))
        sink.emit(wm.Failed("b", "decode-0", "decode", "gone"))
        got = frames(3)
    finally:
        sink.close()
    assert got[0] == [tokens("a", 1)]
    assert got[1] == [tokens(f"r{i}", i) for i in range(5)]
    assert got[2] == [wm.Failed("b", "decode-0", "decode", "gone")]


def test_a_failing_step_still_sends_what_it_emitted_and_empty_steps_send_nothing(receiver):
    address, frames = receiver
    sink = EventSink(address, SECRET, "decode-0")
    try:
        with sink.batch():
            pass  # an idle step: no frame at all
        with pytest.raises(RuntimeError, match="step failed"):
            with sink.batch():
                sink.emit(tokens("r0", 7))
                raise RuntimeError("step failed")
        got = frames(1)
    finally:
        sink.close()
    assert got == [[tokens("r0", 7)]]


def test_a_large_batch_is_split_into_frames_of_at_most_the_cap(receiver, monkeypatch):
    monkeypatch.setattr(serving_loop, "MAX_EVENTS_PER_FRAME", 4)
    address, frames = receiver
    sink = EventSink(address, SECRET, "decode-0")
    try:
        with sink.batch():
            for i in range(10):
                sink.emit(tokens(f"r{i}", i))
        got = frames(3)
    finally:
        sink.close()
    assert [len(f) for f in got] == [4, 4, 2]
    assert [e for f in got for e in f] == [tokens(f"r{i}", i) for i in range(10)]
