"""The `pdserve up` process's control socket: how `pdserve status` and `pdserve scale`, run
from another terminal, reach the running cluster.

ZMQ REQ/REP on the internal address's router.control_port, one msgpack map each way (no
pickle), each signed under the cluster's secret (proto/frame_auth.py; the client finds the secret
with cluster/cluster_secret.py `for_client`). A request that is not signed, or is replayed, is
answered {"ok": false} without being parsed, logged and counted (`rejected`, shown by `pdserve
status --json` as control_rejected):
    {"op": "status"}                                   -> {"ok": true, "status": {...}}
    {"op": "scale", "sizes": {"decode": 2}, "drain_timeout_s": 60}
                                                       -> {"ok": true, "changes": [...]}
    {"op": "flight_dump"}                              -> {"ok": true, "dumps": {process: text}, "missing": {process: why}}
    {"op": "set_role", "worker": "decode-1", "role": "prefill", "reason": "..."}
                                                       -> {"ok": true, "flip": {worker_id, old, role, reason}}
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
from proto.frame_auth import AuthError, ClusterSecret, FrameSigner, FrameVerifier

log = logging.getLogger(__name__)
MAX_CONTROL_BYTES = 1 << 20  # a request is a small map
REPLY = "#reply"  # answers are signed for the address + this: a request can never pass for an answer


class ControlServer:
    def __init__(self, pools: PoolManager, address: str, secret: ClusterSecret) -> None:
        self.pools = pools
        self.address = address
        self.rejected: dict[str, int] = {}  # refused requests by reason
        self._verifier = FrameVerifier(secret, address)
        self._signer = FrameSigner(secret, "control")
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
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)
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
                reply = self._handle(sock.recv_multipart())
                # A REP socket answers every request (refusals too); the answer is signed, so a
                # client knows it came from this cluster's `up` process.
                sock.send_multipart(self._signer.wrap(self.address + REPLY, msgpack.packb(reply, use_bin_type=True)))
        finally:
            sock.close()

    def _handle(self, message: list[bytes]) -> dict:
        try:
            _, parts = self._verifier.verify(message)
        except AuthError as exc:  # never parsed: a peer without the secret gets nothing done
            self.rejected[exc.reason] = self.rejected.get(exc.reason, 0) + 1
            log.warning("refused a control request (%s): %s", exc.reason, str(exc)[:200])
            return {"ok": False, "error": f"refused: {exc.reason}"}
        try:
            if len(parts) != 1:
                raise ScaleError("a control request is one msgpack map after its signature")
            request = msgpack.unpackb(parts[0], raw=False)
            if not isinstance(request, dict):
                raise ScaleError("a control request is a map with an 'op'")
            op = request.get("op")
            if op == "status":
                return {"ok": True, "status": {**self.pools.status(), "control_rejected": dict(self.rejected)}}
            if op == "scale":
                sizes = request.get("sizes")
                if not isinstance(sizes, dict) or not sizes:
                    raise ScaleError("scale needs sizes, e.g. {'decode': 2}")
                drain_s = float(request.get("drain_timeout_s", 60.0))
                return {"ok": True, "changes": [self.pools.scale(role, int(size), drain_s)
                                                for role, size in sizes.items()]}
            if op == "flight_dump":
                from cluster.flight_dumps import collect

                dumps, missing = collect(self.pools.cluster)
                return {"ok": True, "dumps": dumps, "missing": missing}
            if op == "set_role":
                worker, role = request.get("worker"), request.get("role")
                if not isinstance(worker, str) or not isinstance(role, str):
                    raise ScaleError("set_role needs a worker and a role, e.g. {'worker': 'decode-1', 'role': 'prefill'}")
                return {"ok": True, "flip": self.pools.set_role(worker, role, str(request.get("reason") or "asked"))}
            raise ScaleError(f"unknown control op {op!r}; expected 'status', 'scale', 'flight_dump' or 'set_role'")
        except (ScaleError, ValueError, TypeError, msgpack.UnpackException) as exc:
            return {"ok": False, "error": str(exc)}
        except Exception as exc:
            log.exception("control request failed")
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def control_request(address: str, request: dict, timeout_s: float, secret: ClusterSecret) -> dict:
    """Sends one request to a running `up` process; TimeoutError when nothing answers,
    PermissionError when the answer is not signed under `secret`."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, 256 << 20)  # a status of many workers, or their flight recorder dumps
    try:
        sock.connect(f"tcp://{address}")
        sock.send_multipart(FrameSigner(secret, "cli").wrap(address, msgpack.packb(request, use_bin_type=True)))
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no answer from the cluster's control socket at {address} within {timeout_s:.0f} s")
        try:
            _, parts = FrameVerifier(secret, address + REPLY).verify(sock.recv_multipart())
        except AuthError as exc:
            raise PermissionError(f"the answer from {address} is not from this cluster ({exc})") from None
        if len(parts) != 1:
            raise PermissionError(f"the answer from {address} is {len(parts)} parts, not one")
        return msgpack.unpackb(parts[0], raw=False)
    finally:
        sock.close()
