"""KV frames over ZMQ (CPU/TCP): a PUSH socket per prefill->decode link, a PULL socket bound by
each decode worker on its configured port. Headers are msgpack; payloads go zero-copy
(`copy=False, track=True`: the page bytes are not copied into ZMQ, and the sender keeps them
alive until the tracker says ZMQ is done with them). Nothing is pickled.

Every frame travels as `[auth, header, payload?]`, signed under the cluster's secret for the
receiver's address (proto/frame_auth.py); the receiver checks it before parsing the header, and
drops and counts (`on_reject("kv", reason)`) a frame that fails. What the signature covers
(`sign_payload`, the same on both ends, from kv_transfer.checksum): with the checksum on (the
default) the header only, because the header carries the payload's CRC-32, which the receiver
requires, so the payload is bound through it at no cost beyond the CRC; HMAC-SHA256 over the
payload itself would cost ~0.6 ms per MiB on each side (1.6 GiB/s on one core, measured with
hashlib against CRC-32's ~5 GiB/s and loopback TCP's ~2.5 GiB/s; a header takes ~6 us to sign
and check). With the checksum off, the signature covers the payload too (and by default: a link
whose owner says nothing is fully signed). What the header-only choice leaves open: an attacker on the path who rewrites a frame
in flight could swap its payload for one with the same CRC-32 (CRC is not a cryptographic hash);
one who can only reach the port cannot, lacking a signed header.

Link state (`ZmqFrameSender.link_error`): a socket monitor reports the connection's handshake
and its loss; ZMTP heartbeats (`heartbeat_s`) find a peer that vanished without closing its
connection; a send that timed out counts until a later one succeeds. ZMQ reconnects by itself,
so a link that went down comes back up when its decode worker does (same address).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.kv_transfer.frames import MAX_FRAME_BYTES, Frame, parse_header
from engine.kv_transfer.transport import BaseFrameReceiver, BaseFrameSender, TransportError
from proto.frame_auth import AuthError, ClusterSecret, FrameSigner, FrameVerifier

log = logging.getLogger(__name__)


class ZmqFrameReceiver(BaseFrameReceiver):
    def __init__(self, host: str, port: int, secret: ClusterSecret, sign_payload: bool = True,
                 on_reject: Callable[[str, str], None] = lambda socket, reason: None,
                 context: zmq.Context | None = None) -> None:
        """Binds host:port; port 0 picks a free port (tests only: real ports come from config).
        `on_reject(socket, reason)`: a dropped frame, for the worker's counters."""
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # a larger one drops its connection
        self.num_rejected = 0  # frames dropped: not signed, replayed, or a malformed header
        self.on_reject = on_reject
        self.sign_payload = sign_payload
        if port == 0:
            self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        else:
            self._sock.bind(f"tcp://{host}:{port}")
            self.port = port
        self.address = f"{host}:{self.port}"
        self._verifier = FrameVerifier(secret, self.address)

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
                frames.append(self._open(parts))
            except AuthError as exc:  # never parsed: a peer without the secret gets nothing done
                self._reject(exc.reason, exc)
            except ValueError as exc:  # one bad frame is dropped, never the receiver
                self._reject("malformed", exc)

    def _open(self, parts: list[zmq.Frame]) -> Frame:
        if not 2 <= len(parts) <= 3:
            raise AuthError("unauthenticated", f"a KV frame is [auth, header, payload?], not {len(parts)} parts")
        signed = parts if self.sign_payload else parts[:2]
        self._verifier.verify([parts[0].bytes, parts[1].bytes, *(p.buffer for p in signed[2:])])
        header = parse_header(parts[1].bytes)
        return Frame(header, parts[2].buffer if len(parts) > 2 else b"")

    def _reject(self, reason: str, exc: Exception) -> None:
        self.num_rejected += 1
        self.on_reject("kv", reason)
        log.warning("dropped a KV frame on %s (%s): %s", self.address, reason, str(exc)[:200])

    def close(self) -> None:
        self._sock.close()


_UP_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED
_DOWN_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


class ZmqFrameSender(BaseFrameSender):
    def __init__(self, address: str, secret: ClusterSecret, name: str = "kv", sign_payload: bool = True,
                 send_timeout_s: float = 5.0, context: zmq.Context | None = None, heartbeat_s: float = 5.0,
                 connect_grace_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        """`name`: the sending worker's id (the receiver logs it); `sign_payload`: as the
        receiver's (kv_transfer.checksum off); `heartbeat_s`: ZMTP ping interval (a peer silent
        for 3 of them is disconnected); `connect_grace_s`: how long a link that never connected
        counts as still connecting rather than down."""
        self.address = address
        self.sign_payload = sign_payload
        self._signer = FrameSigner(secret, name)  # this link's own: the receiver sees its counters in order
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Queue only to a connected peer: with no decode worker listening, send times out and
        # the transfer fails, instead of piling KV into a buffer nobody drains.
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_s * 1000))
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(3 * heartbeat_s * 1000))
        self._monitor = self._sock.get_monitor_socket(_UP_EVENTS | _DOWN_EVENTS)
        self._clock = clock
        self._opened = clock()
        self._connect_grace_s = connect_grace_s
        self._connected: bool | None = None  # None: not connected yet; False: lost (reconnecting)
        self._send_error = ""  # the last send failed (cleared by one that succeeds)
        self._sock.connect(f"tcp://{address}")
        self._in_flight: list[tuple[zmq.MessageTracker, object]] = []

    def link_error(self) -> str | None:
        while True:  # the connection's events since the last look (on the sending thread, as the socket)
            try:
                event = recv_monitor_message(self._monitor, flags=zmq.NOBLOCK)["event"]
            except zmq.Again:
                break
            self._connected = bool(event & _UP_EVENTS)
        if self._send_error:
            return f"KV send to {self.address} failed: {self._send_error}"
        if self._connected is False:
            return f"disconnected from {self.address} (reconnecting)"
        if self._connected is None and self._clock() - self._opened > self._connect_grace_s:
            return f"not connected to {self.address} after {self._clock() - self._opened:.1f} s"
        return None

    def send(self, frame: Frame) -> Callable[[], bool]:
        header = msgpack.packb(frame.header, use_bin_type=True)
        payload = [frame.payload] if len(frame.payload) else []
        auth = self._signer.sign(self.address, [header, *payload] if self.sign_payload else [header])
        parts = [auth, header, *payload]
        try:
            tracker = self._sock.send_multipart(parts, copy=False, track=True)
        except zmq.Again as exc:
            self._send_error = "send timed out: no receiver took the frame"
            raise TransportError(f"send timed out: no receiver took the frame ({exc})") from exc
        except zmq.ZMQError as exc:
            self._send_error = str(exc)[:200]
            raise TransportError(str(exc)) from exc
        self._send_error = ""
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
        self._sock.disable_monitor()
        self._monitor.close()
        self._sock.close()

