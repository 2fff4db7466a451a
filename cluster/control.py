"""The `pdserve up` process's control socket: how `pdserve status` and `pdserve scale`, run
from another terminal, reach the running cluster.

ZMQ REQ/REP on router.host:router.control_port, one msgpack map each way (no pickle):
    {"op": "status"}                                   -> {"ok": true, "status": {...}}
    {"op": "scale", "sizes": {"decode": 2}, "drain_timeout_s": 60}
                                                       -> {"ok": true, "changes": [...]}
    anything that fails                                -> {"ok": false, "error": "why"}
Requests are served one at a time on a thread of the `up` process (a scale that drains waits
for its requests; a status sent meanwhile answers after it).
"""

from __future__ import annotations

import logging
import threading

import msgpack
import zmq

from cluster.pools import PoolManager, ScaleError

log = logging.getLogger(__name__)


class ControlServer:
    def __init__(self, pools: PoolManager, address: str) -> None:
        self.pools = pools
        self.address = address
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pdserve-control", daemon=True)

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread.start()
        self._bound.wait(timeout_s)
        if self._error is not None:
            raise RuntimeError(f"control socket on {self.address}: {self._error}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(f"tcp://{self.address}")
        except zmq.ZMQError as exc:
            self._error = exc
            self._bound.set()
            sock.close()
            return
        self._bound.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(200):
                    continue
                data = sock.recv()
                sock.send(msgpack.packb(self._handle(data), use_bin_type=True))
        finally:
            sock.close()

    def _handle(self, data: bytes) -> dict:
        try:
            request = msgpack.unpackb(data, raw=False)
            if not isinstance(request, dict):
                raise ScaleError("a control request is a map with an 'op'")
            op = request.get("op")
            if op == "status":
                return {"ok": True, "status": self.pools.status()}
            if op == "scale":
                sizes = request.get("sizes")
                if not isinstance(sizes, dict) or not sizes:
                    raise ScaleError("scale needs sizes, e.g. {'decode': 2}")
                drain_s = float(request.get("drain_timeout_s", 60.0))
                return {"ok": True, "changes": [self.pools.scale(role, int(size), drain_s)
                                                for role, size in sizes.items()]}
            raise ScaleError(f"unknown control op {op!r}; expected 'status' or 'scale'")
        except (ScaleError, ValueError, TypeError, msgpack.UnpackException) as exc:
            return {"ok": False, "error": str(exc)}
        except Exception as exc:
            log.exception("control request failed")
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def control_request(address: str, request: dict, timeout_s: float) -> dict:
    """Sends one request to a running `up` process; TimeoutError when nothing answers."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{address}")
        sock.send(msgpack.packb(request, use_bin_type=True))
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no answer from the cluster's control socket at {address} within {timeout_s:.0f} s")
        return msgpack.unpackb(sock.recv(), raw=False)
    finally:
        sock.close()
