"""KV links: what a prefill worker knows of each (engine/kv_transfer/links.py, the ZMQ sender's
link state), how a torch_dist decode worker takes frames from two transports
(engine/kv_transfer/multi_receiver.py), and how the router turns the heartbeats' link reports
into a route per (prefill, decode) pair, a fallback, or none (router/worker_pool.py)."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from engine.kv_transfer.frames import pages_frame
from engine.kv_transfer.inproc import InProcChannel
from engine.kv_transfer.links import KVLinks
from engine.kv_transfer.multi_receiver import MultiFrameReceiver
from engine.kv_transfer.transport import BaseFrameSender
from engine.kv_transfer.zmq_transport import ZmqFrameReceiver, ZmqFrameSender
from proto import worker_messages as wm
from proto.frame_auth import ClusterSecret
from router import worker_pool
from router.metrics import RouterMetrics
from router.worker_pool import WorkerEndpoint, WorkerPool
from tests.local_cluster import free_port


def _wait(predicate, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return value


def test_a_zmq_link_is_connecting_then_down_then_up_and_back_after_its_receiver_returns():
    secret, port = ClusterSecret.generate(), free_port()
    sender = ZmqFrameSender(f"127.0.0.1:{port}", secret, heartbeat_s=0.2, connect_grace_s=0.3)
    try:
        assert sender.link_error() is None  # connecting: not down yet
        assert "not connected to 127.0.0.1" in _wait(sender.link_error)
        receiver = ZmqFrameReceiver("127.0.0.1", port, secret)
        _wait(lambda: sender.link_error() is None)
        receiver.close()
        assert "disconnected from" in _wait(sender.link_error)
        receiver = ZmqFrameReceiver("127.0.0.1", port, secret)  # ZMQ reconnects by itself
        _wait(lambda: sender.link_error() is None)
        sender.send(pages_frame("r", 0, torch.ones(2, 1, 1, 1, 4, 8), checksum=True))
        assert [f.header["request_id"] for f in _wait(lambda: receiver.recv(0.1))] == ["r"]
        receiver.close()
    finally:
        sender.close()


class _Frames(BaseFrameSender):
    def __init__(self, address: str) -> None:
        self.address, self.error, self.closed = address, None, False

    def send(self, frame):
        return lambda: True

    def link_error(self):
        return self.error

    def close(self) -> None:
        self.closed = True


def test_links_open_ahead_report_states_once_and_close_what_left(caplog):
    opened: dict[str, _Frames] = {}

    def open_frames(address: str) -> _Frames:
        opened[address] = _Frames(address)
        return opened[address]

    links = KVLinks(open_frames)
    links.keep(["a:1", "b:2"])
    assert sorted(opened) == ["a:1", "b:2"]
    assert links.sender("a:1") is links.sender("a:1")  # one connection per endpoint
    assert [(s.address, s.up) for s in links.states()] == [("a:1", True), ("b:2", True)]
    opened["b:2"].error = "peer gone"
    with caplog.at_level(logging.WARNING):
        assert [(s.address, s.error) for s in links.states()] == [("a:1", None), ("b:2", "peer gone")]
        links.states()  # the same state again: not logged again
    assert [r.getMessage() for r in caplog.records] == ["KV link to b:2 is down: peer gone"]
    links.sender("a:1").begin("busy", 10.0)  # a transfer in progress keeps its link open
    links.keep(["c:3"])
    assert opened["b:2"].closed and not opened["a:1"].closed and "c:3" in opened
    links.sender("a:1").abort("busy", "done")
    links.keep(["c:3"])
    assert opened["a:1"].closed
    links.close()
    assert opened["c:3"].closed


def test_a_multi_receiver_takes_frames_from_every_transport_and_waits_on_all():
    secret, port = ClusterSecret.generate(), free_port()
    channel = InProcChannel()
    zmq_receiver = ZmqFrameReceiver("127.0.0.1", port, secret)
    receiver = MultiFrameReceiver(channel.receiver, zmq_receiver)
    sender = ZmqFrameSender(f"127.0.0.1:{port}", secret)
    try:
        start = time.monotonic()
        assert receiver.recv(0.05) == [] and time.monotonic() - start >= 0.05
        sender.send(pages_frame("over-zmq", 0, torch.ones(2, 1, 1, 1, 4, 8), checksum=True))
        channel.sender.send(pages_frame("in-proc", 0, torch.ones(2, 1, 1, 1, 4, 8), checksum=True))
        got: list[str] = []
        deadline = time.monotonic() + 5
        while len(got) < 2 and time.monotonic() < deadline:
            got += [f.header["request_id"] for f in receiver.recv(0.5)]
        assert sorted(got) == ["in-proc", "over-zmq"]
    finally:
        sender.close()
        receiver.close()


@pytest.fixture
def pool():
    endpoints = [WorkerEndpoint("prefill-0", "prefill", "127.0.0.1:1", kv_source="dist:0"),
                 WorkerEndpoint("prefill-1", "prefill", "127.0.0.1:2", kv_source="dist:1"),
                 WorkerEndpoint("decode-0", "decode", "127.0.0.1:3", "dist:2", kv_fallback_address="127.0.0.1:9"),
                 WorkerEndpoint("decode-1", "decode", "127.0.0.1:4", "dist:3", kv_fallback_address="127.0.0.1:8")]
    p = WorkerPool(endpoints, f"127.0.0.1:{free_port()}", ClusterSecret.generate())
    yield p
    for w in p._workers.values():
        w.commands.close()
    p._events.close()


def beat(pool: WorkerPool, worker_id: str, role: str, *links: wm.KVLink) -> None:
    pool._dispatch(wm.decode(wm.encode(wm.Load(worker_id, role, 0, 10, 0, "1", links))))


def test_the_router_routes_each_pair_over_its_link_its_fallback_or_not_at_all(pool):
    for w, role in (("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")):
        beat(pool, w, role)
    assert pool.kv_route("prefill-0", "decode-0") == "dist:2"
    # prefill-0's own sender failed: its KV for decode-0 goes over ZMQ; prefill-1 is unaffected
    beat(pool, "prefill-0", "prefill", wm.KVLink("dist:2", False, "send failed: Connection closed by peer"),
         wm.KVLink("127.0.0.1:9", True))
    assert pool.kv_route("prefill-0", "decode-0") == "127.0.0.1:9"
    assert pool.kv_route("prefill-1", "decode-0") == "dist:2"
    assert pool.link_view("prefill-0", "decode-0") == {
        "up": False, "error": "send failed: Connection closed by peer", "route": "127.0.0.1:9", "fallback": True}
    # decode-1 no longer hears prefill-1 (its receive thread ended): the prefill side may not know
    beat(pool, "decode-1", "decode", wm.KVLink("dist:1", False, "receive failed: timeout"))
    assert pool.link_error("prefill-1", "dist:3") == "decode-1 no longer hears it: receive failed: timeout"
    assert pool.kv_route("prefill-1", "decode-1") == "127.0.0.1:8"
    assert pool.kv_route("prefill-0", "decode-1") == "dist:3"
    # both ways down: no route at all for the pair
    beat(pool, "prefill-0", "prefill", wm.KVLink("dist:2", False, "x"), wm.KVLink("127.0.0.1:9", False, "y"))
    assert pool.kv_route("prefill-0", "decode-0") is None
    view = {w["worker_id"]: w for w in pool.view()}
    assert view["prefill-0"]["kv_links"]["decode-0"] == {"up": False, "error": "x", "route": None, "fallback": False}
    assert view["prefill-1"]["kv_links"]["decode-0"]["up"] and "kv_links" not in view["decode-0"]
    metrics = RouterMetrics()
    metrics.watch_kv_links(pool.link_states)
    text = metrics.exposition().decode()
    assert 'pdserve_kv_link_up{dst="decode-0",src="prefill-0"} 0.0' in text
    assert 'pdserve_kv_link_up{dst="decode-0",src="prefill-1"} 1.0' in text
    assert 'pdserve_kv_link_up{dst="decode-1",src="prefill-1"} 0.0' in text


def test_a_failed_transfer_makes_its_link_suspect_until_a_later_heartbeat(pool, monkeypatch):
    for w, role in (("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")):
        beat(pool, w, role)
    pool.suspect("prefill-0", "dist:2")
    assert pool.kv_route("prefill-0", "decode-0") == "127.0.0.1:9"  # a retry at once avoids it
    beat(pool, "prefill-0", "prefill")  # built before the failure was known: still suspect
    assert pool.link_error("prefill-0", "dist:2") == "a transfer over it just failed"
    monkeypatch.setattr(worker_pool, "SUSPECT_LINK_S", 0.0)
    beat(pool, "prefill-0", "prefill")  # a heartbeat that knows of it, saying nothing is wrong
    assert pool.kv_route("prefill-0", "decode-0") == "dist:2"
