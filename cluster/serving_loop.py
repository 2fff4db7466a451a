"""The socket loop that runs one worker role (prefill, decode or colocated) in its process.

Router commands arrive on a PULL socket the worker binds (its configured port); events go to
the router's PULL socket through a PUSH. The loop alternates: take in every waiting command,
run one step of the role, publish its snapshot; a Load heartbeat, read from that snapshot, goes
out from a thread of its own. It blocks on the command socket
only when the role has nothing to do. Messages are msgpack (proto/worker_messages.py); a
malformed one is logged and dropped, never fatal.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

import zmq

from proto import worker_messages as wm

log = logging.getLogger(__name__)
MAX_COMMAND_BYTES = 16 << 20  # the largest command: a prompt of up to 1M token ids is ~9 MiB


class WorkerRole(Protocol):
    def handle(self, message: object) -> None: ...

    def step(self) -> bool: ...

    def publish(self) -> None: ...


class EventSink:
    """Thread-confined PUSH socket to the router; `emit` is what roles call."""

    def __init__(self, router_event_address: str, context: zmq.Context | None = None) -> None:
        self.address = router_event_address
        self._sock = (context or zmq.Context.instance()).socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(f"tcp://{router_event_address}")

    def emit(self, message: object) -> None:
        self._sock.send(wm.encode(message))

    def close(self) -> None:
        self._sock.close()


def serve(
    role: WorkerRole,
    command_address: str,
    events: EventSink,
    load: Callable[[], wm.Load],
    stop: threading.Event,
    heartbeat_s: float = 0.5,
    idle_wait_s: float = 0.01,
    on_ready: Callable[[], None] | None = None,
) -> None:
    """Runs until `stop` is set. `command_address` is host:port to bind."""
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_COMMAND_BYTES)  # a larger one drops its connection
    sock.bind(f"tcp://{command_address}")
    # Heartbeats come from a thread of their own (with its own socket: ZMQ sockets are
    # thread-confined), so one long step (a 2k-token prefill can take seconds on a CPU) never
    # looks like a dead worker to the router. torch releases the GIL while it computes.
    beat = threading.Thread(target=_heartbeat, args=(events.address, load, stop, heartbeat_s),
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
                        data = sock.recv(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        role.handle(wm.decode(data))
                    except ValueError as exc:  # malformed, or a message this role does not take
                        log.warning("dropped a bad command on %s: %s", command_address, str(exc)[:200])
                    except Exception as exc:  # noqa: BLE001 - one command never ends the loop
                        log.error("command on %s failed: %s: %s", command_address, type(exc).__name__, exc)
            busy = role.step()
            role.publish()  # the heartbeat thread and status reads see this turn's state
    except BaseException:
        stop.set()  # the loop died: heartbeats stop with it, so the router sees a dead worker, not a zombie
        raise
    finally:
        sock.close()
        beat.join(heartbeat_s + 1)


def _heartbeat(router_event_address: str, load: Callable[[], wm.Load], stop: threading.Event,
               heartbeat_s: float) -> None:
    sink = EventSink(router_event_address)
    try:
        while not stop.is_set():
            sink.emit(load())  # built from published snapshots: nothing here races the step loop
            stop.wait(heartbeat_s)
    finally:
        sink.close()
