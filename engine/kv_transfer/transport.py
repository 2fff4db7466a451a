"""The transport seam: what a KV transport must do to move `Frame`s (frames.py) from one
prefill worker to one decode worker. Implementations: inproc.py (unit-test twin),
zmq_transport.py (TCP, zero-copy), torch_dist.py (gloo/NCCL). They only move frames; the
sender and receiver rules live in sender.py and receiver.py."""

from __future__ import annotations

from collections.abc import Callable

from engine.kv_transfer.frames import Frame


class TransportError(RuntimeError):
    """A frame could not be handed to the transport (peer gone, send timed out)."""


class BaseFrameSender:
    """Moves frames to one receiver. `send` may return before the bytes left (zero-copy): it
    returns a callable telling whether the payload's memory may be reused yet; `flush` waits
    until that is true of every sent payload."""

    def send(self, frame: Frame) -> Callable[[], bool]:
        raise NotImplementedError

    def flush(self, timeout_s: float) -> bool:
        return True

    def link_error(self) -> str | None:
        """Why this link cannot carry frames now (None: it can, or is still connecting). Called
        on the thread that sends; the worker reports it in its heartbeats (the router routes
        around a link that is down)."""
        return None

    def close(self) -> None:
        pass


class BaseFrameReceiver:
    def recv(self, timeout_s: float) -> list[Frame]:
        """Frames that arrived, waiting up to timeout_s for the first one."""
        raise NotImplementedError

    def link_errors(self) -> dict[str, str]:
        """The senders this receiver can no longer hear, by their KV address -> why (a
        torch.distributed source whose stream ended; a ZMQ receiver hears any sender)."""
        return {}

    def close(self) -> None:
        pass
