"""The socket loop that runs one worker role (prefill, decode or colocated) in its process.

Router commands arrive on a PULL socket the worker binds (its configured port); events go to
the router's PULL socket through a PUSH. The loop alternates: take in every waiting command,
run one step of the role, publish its snapshot; a Load heartbeat, read from that snapshot, goes
out from a thread of its own. It blocks on the command socket
only when the role has nothing to do. Messages are msgpack (proto/worker_messages.py), signed
under the cluster's secret both ways (proto/frame_auth.py). A command that is not signed,
replayed, malformed, or one the role refuses is logged (with its request id once it is
authentic), counted through `on_reject("commands", reason)` and dropped, never fatal.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

import zmq

from proto import worker_messages as wm
from proto.flight.recorder import IN, OUT, UNRECORDED, FlightRecorder
from proto.frame_auth import AuthError, ClusterSecret, FrameSigner, FrameVerifier

log = logging.getLogger(__name__)
MAX_COMMAND_BYTES = 16 << 20  # the largest command: a prompt of up to 1M token ids is ~9 MiB
MAX_EVENTS_PER_FRAME = 256  # events of one step per frame (the router takes any number of parts)


class WorkerRole(Protocol):
    worker_id: str
    batch_events: bool  # a step's events leave together (EventSink.batch); False: each as emitted

    def handle(self, message: object) -> None: ...

    def step(self) -> bool: ...

    def publish(self) -> None: ...


OnReject = Callable[[str, str], None]  # (socket, reason): a dropped message, counted by the worker


class EventSink:
    """Thread-confined PUSH socket to the router; `emit` is what roles call. Each sink signs
    with a signer of its own (`name`: the worker's id, for the router's log lines).

    Inside `batch()` (the serving loop wraps each step in it) events are held and leave as one
    signed frame of one part per event when the step ends: a decode step of 32 sequences sent
    32 frames, each a ZMQ send (~20 us on the step's thread) and a receive and HMAC check on
    the router, which shares the compute cores. Served quick bursts of vs_vllm.py (builtin:small
    bf16, 2 cores, two runs each way): router CPU 1.31-1.39 against 1.68-1.77 s, burst
    4.40-4.47 against 4.26-4.27 req/s."""

    def __init__(self, router_event_address: str, secret: ClusterSecret, name: str,
                 context: zmq.Context | None = None, recorder: FlightRecorder | None = None) -> None:
        """`recorder`: keeps every request's event sent (proto/flight/); the heartbeat's twin has none."""
        self.address, self.name, self._secret = router_event_address, name, secret
        self.recorder = recorder
        self._signer = FrameSigner(secret, name)
        self._sock = (context or zmq.Context.instance()).socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(f"tcp://{router_event_address}")
        self._held: list[bytes] | None = None  # events of the step in progress, inside batch()

    def twin(self) -> EventSink:
        """Another sink to the same router, for another thread (its own socket and counter)."""
        return EventSink(self.address, self._secret, self.name)

    def emit(self, message: object) -> None:
        encoded = wm.encode(message)
        if self.recorder is not None and type(message).__name__ not in UNRECORDED:
            self.recorder.message(OUT, "router", getattr(message, "request_id", None), encoded)
        if self._held is None:
            self._send([encoded])
            return
        self._held.append(encoded)
        if len(self._held) >= MAX_EVENTS_PER_FRAME:
            self._send(self._held)
            self._held = []

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Holds what is emitted inside, then sends it as one frame (also when the block raises:
        what the step emitted before failing still reaches the router)."""
        self._held = []
        try:
            yield
        finally:
            held, self._held = self._held, None
            if held:
                self._send(held)

    def _send(self, parts: list[bytes]) -> None:
        self._sock.send_multipart(self._signer.wrap(self.address, *parts))

    def close(self) -> None:
        self._sock.close()


def serve(
    role: WorkerRole,
    command_address: str,
    events: EventSink,
    load: Callable[[], wm.Load],
    stop: threading.Event,
    secret: ClusterSecret,
    on_reject: OnReject = lambda socket, reason: None,
    heartbeat_s: float = 0.5,
    idle_wait_s: float = 0.01,
    on_ready: Callable[[], None] | None = None,
    notices: Callable[[], list[object]] = lambda: [],
) -> None:
    """Runs until `stop` is set. `command_address` is host:port to bind; only commands signed
    under `secret` for that address are taken. `notices()`: events that belong to no request
    (KV block changes), read on this thread after each publish and sent at once."""
    verifier = FrameVerifier(secret, command_address)
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_COMMAND_BYTES)  # a larger one drops its connection
    sock.bind(f"tcp://{command_address}")
    # Heartbeats come from a thread of their own (with its own socket: ZMQ sockets are
    # thread-confined), so one long step (a 2k-token prefill can take seconds on a CPU) never
    # looks like a dead worker to the router. torch releases the GIL while it computes.
    beat = threading.Thread(target=_heartbeat, args=(events.twin, load, stop, heartbeat_s),
                            name="pdserve-heartbeat", daemon=True)
    beat.start()
    if on_ready is not None:
        on_ready()
    busy = False
    try:
        while not stop.is_set():
            if sock.poll(0 if busy else int(idle_wait_s * 1000)):
                while True:
                    try:
                        message = sock.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    _take(role, verifier, message, on_reject, events.emit, events.recorder)
            with events.batch() if role.batch_events else contextlib.nullcontext():  # one frame a step
                busy = role.step()
            role.publish()  # the heartbeat thread and status reads see this turn's state
            for notice in notices():
                events.emit(notice)
    except BaseException:
        stop.set()  # the loop died: heartbeats stop with it, so the router sees a dead worker, not a zombie
        raise
    finally:
        sock.close()
        beat.join(heartbeat_s + 1)


def _take(role: WorkerRole, verifier: FrameVerifier, message: list[bytes], on_reject: OnReject,
          emit: Callable[[object], None], recorder: FlightRecorder | None = None) -> None:
    """One received command to the role, or dropped, logged and counted with why. A signed
    command that names a request but cannot be taken (a malformed field, a message this role does
    not take, an error handling it) is answered with Failed(stage "command") naming why, so the
    router fails that request at once instead of waiting for its deadline."""
    where, command, payload = verifier.audience, None, None
    try:
        sender, parts = verifier.verify(message)  # nothing is parsed before this
        if len(parts) != 1:
            raise ValueError(f"a command is one part after its signature, not {len(parts)}")
        payload = bytes(parts[0])  # signed: its request id is the router's own, worth answering
        try:
            command = wm.decode(payload)
        finally:  # recorded before it is handled, a refused one too: a dump shows what came in
            if recorder is not None:
                recorder.message(IN, "router", _request_id(command, payload), payload)
        role.handle(command)
    except AuthError as exc:  # not from this cluster's router: no request id worth believing
        on_reject("commands", exc.reason)
        log.warning("refused a command on %s (%s): %s", where, exc.reason, str(exc)[:200])
    except ValueError as exc:  # malformed, or a message this role does not take
        request_id = _request_id(command, payload)
        on_reject("commands", "malformed" if command is None else "refused")
        log.warning("dropped a bad command on %s (request %s): %s", where, request_id, str(exc)[:200])
        _answer(emit, request_id, role.worker_id,
                f"{'malformed' if command is None else 'refused'} command: {str(exc)[:wm.MAX_TEXT_CHARS - 100]}")
    except Exception as exc:  # noqa: BLE001 - one command never ends the loop
        request_id = _request_id(command, payload)
        on_reject("commands", "error")
        log.error("command on %s (request %s) failed: %s: %s", where, request_id, type(exc).__name__, exc)
        _answer(emit, request_id, role.worker_id, f"command failed: {type(exc).__name__}: {str(exc)[:1000]}")


def _request_id(command: object, payload: bytes | None) -> str | None:
    """The failed command's request id: the decoded one, else read from the signed payload
    (only on this error path: a good command is parsed once)."""
    if command is not None:
        return getattr(command, "request_id", None)
    return None if payload is None else wm.request_id_of(payload)


def _answer(emit: Callable[[object], None], request_id: str | None, worker_id: str, reason: str) -> None:
    if request_id is not None:
        emit(wm.Failed(request_id, worker_id, "command", reason))


def _heartbeat(make_sink: Callable[[], EventSink], load: Callable[[], wm.Load], stop: threading.Event,
               heartbeat_s: float) -> None:
    sink = make_sink()  # made on the thread that uses it
    try:
        while not stop.is_set():
            sink.emit(load())  # built from published snapshots: nothing here races the step loop
            stop.wait(heartbeat_s)
    finally:
        sink.close()
