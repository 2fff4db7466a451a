"""KV frames over ZMQ (CPU/TCP): a PUSH socket per prefill->decode link, a PULL socket bound by
each decode worker on its configured port. Headers are msgpack; payloads go zero-copy
(`copy=False, track=True`: the page bytes are not copied into ZMQ, and the sender keeps them
alive until the tracker says ZMQ is done with them). Nothing is pickled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgpack
import zmq

from engine.kv_transfer.frames import Frame, parse_header
from engine.kv_transfer.transport import BaseFrameReceiver, BaseFrameSender, TransportError

log = logging.getLogger(__name__)
# The largest frame a decode worker takes: 8 pages of a 70B-class model are ~40 MiB.
MAX_FRAME_BYTES = 256 << 20


class ZmqFrameReceiver(BaseFrameReceiver):
    def __init__(self, host: str, port: int, context: zmq.Context | None = None) -> None:
        """Binds host:port; port 0 picks a free port (tests only: real ports come from config)."""
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # a larger one drops its connection
        self.num_rejected = 0  # frames dropped for a malformed header
        if port == 0:
            self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        else:
            self._sock.bind(f"tcp://{host}:{port}")
            self.port = port
        self.address = f"{host}:{self.port}"

    def recv(self, timeout_s: float) -> list[Frame]:
        frames: list[Frame] = []
        if not self._sock.poll(int(timeout_s * 1000)):
            return frames
        while True:
            try:
                parts = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return frames
            try:
                header = parse_header(parts[0].bytes)
            except ValueError as exc:  # one bad frame is dropped, never the receiver
                self.num_rejected += 1
                log.warning("dropped a bad KV frame on %s: %s", self.address, exc)
                continue
            payload = parts[1].buffer if len(parts) > 1 else b""
            frames.append(Frame(header, payload))

    def close(self) -> None:
        self._sock.close()


class ZmqFrameSender(BaseFrameSender):
    def __init__(self, address: str, send_timeout_s: float = 5.0, context: zmq.Context | None = None) -> None:
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Queue only to a connected peer: with no decode worker listening, send times out and
        # the transfer fails, instead of piling KV into a buffer nobody drains.
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
        self._sock.connect(f"tcp://{address}")
        self._in_flight: list[tuple[zmq.MessageTracker, object]] = []

    def send(self, frame: Frame) -> Callable[[], bool]:
        header = msgpack.packb(frame.header, use_bin_type=True)
        parts = [header, frame.payload] if len(frame.payload) else [header]
        try:
            tracker = self._sock.send_multipart(parts, copy=False, track=True)
        except zmq.Again as exc:
            raise TransportError(f"send timed out: no receiver took the frame ({exc})") from exc
        except zmq.ZMQError as exc:
            raise TransportError(str(exc)) from exc
        self._in_flight.append((tracker, frame.payload))  # keep the bytes alive until sent
        if len(self._in_flight) > 64:  # drop the entries ZMQ is done with
            self._in_flight = [(t, p) for t, p in self._in_flight if not t.done]
        return lambda: tracker.done

    def flush(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._in_flight:
            tracker, _ = self._in_flight[0]
            try:
                tracker.wait(max(0.0, deadline - time.monotonic()))
            except zmq.NotDone:
                return False
            self._in_flight.pop(0)
        return True

    def close(self) -> None:
        self._sock.close()

