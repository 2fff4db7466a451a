"""The prefill side of a KV transfer: `begin` with a deadline, page frames as the KV becomes
ready, then `finish` (DONE, or EXPIRED / FAILED with an abort frame to the receiver) or `abort`.
Every transfer ends in exactly one state; the prefill worker releases its held KV after `finish`
or `abort`, whatever the outcome. One `_Outgoing` record per request id: ending a transfer is
one deletion."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.kv_cache import KVCache
from engine.kv_transfer.frames import (
    Frame,
    TransferObserver,
    TransferProgress,
    TransferState,
    abort_frame,
    done_frame,
    pages_frame,
)
from engine.kv_transfer.link_meter import LinkMeter
from engine.kv_transfer.transport import BaseFrameSender, TransportError


class StagingBuffers:
    """Reusable buffers for page frames. Pages are scattered in the cache, so a frame is
    gathered into one buffer first; a fresh buffer each time costs more in page faults than
    the copy itself, so buffers are recycled once the transport is done with them."""

    def __init__(self) -> None:
        self._buffers: list[tuple[torch.Tensor, Callable[[], bool]]] = []

    def acquire(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        for i, (buf, reusable) in enumerate(self._buffers):
            if buf.shape == shape and buf.dtype == dtype and buf.device == device and reusable():
                del self._buffers[i]
                return buf
        return torch.empty(shape, dtype=dtype, device=device)

    def release(self, buf: torch.Tensor, reusable: Callable[[], bool]) -> None:
        self._buffers.append((buf, reusable))
        del self._buffers[:-8]  # keep a bounded number around


@dataclass
class _Outgoing:
    """One transfer in progress on the sending side."""

    deadline: float  # clock() value
    token: str = ""  # the transfer's secret from its reservation, carried by every frame
    num_pages: int = 0  # destination pages covered so far (the done frame states it)
    progress: TransferProgress = field(default_factory=TransferProgress)
    # (payload bytes, whether the transport is done with them) of each frame handed over: what
    # is still in flight when the prefill finishes is the link's cost to the request (`meter`).
    frames: list[tuple[int, Callable[[], bool]]] = field(default_factory=list)


class KVSender:
    def __init__(self, transport: BaseFrameSender, checksum: bool = False, clock=time.monotonic,
                 observer: TransferObserver | None = None) -> None:
        self.transport = transport
        self.checksum = checksum
        self.clock = clock
        self.observer = observer
        self.staging = StagingBuffers()
        self.meter = LinkMeter()  # this link's latency and bandwidth, from the tails of its transfers
        self._outgoing: dict[str, _Outgoing] = {}

    @property
    def num_in_progress(self) -> int:
        """Transfers begun and not ended on this link."""
        return len(self._outgoing)

    def request_ids(self) -> set[str]:
        """The requests whose transfer on this link has begun and not ended."""
        return set(self._outgoing)

    def begin(self, request_id: str, timeout_s: float, token: str = "") -> None:
        """`token`: the secret the decode side gave the reservation (KVDestination.token)."""
        if request_id in self._outgoing:
            raise ValueError(f"a transfer for {request_id!r} is already in progress")
        self._outgoing[request_id] = _Outgoing(self.clock() + timeout_s, token)

    def send_pages(self, request_id: str, first_page: int, data: torch.Tensor) -> None:
        """Sends pages [first_page, first_page + n) of the destination list (data: read_pages)."""
        entry = self._get(request_id)
        self._send(entry, pages_frame(request_id, first_page, data, self.checksum, entry.token),
                   first_page + int(data.shape[2]))

    def send_cache_pages(self, request_id: str, first_page: int, kv_cache: KVCache, page_ids: list[int]) -> None:
        """send_pages for pages read straight from a cache, through a recycled staging buffer."""
        entry = self._get(request_id)
        buf = self.staging.acquire(kv_cache.pages_shape(len(page_ids)), kv_cache.dtype, kv_cache.device)
        kv_cache.read_pages(page_ids, out=buf)
        reusable = self._send(entry, pages_frame(request_id, first_page, buf, self.checksum, entry.token),
                              first_page + len(page_ids))
        self.staging.release(buf, reusable)

    def finish(self, request_id: str, first_token: int | None = None) -> TransferState:
        """Ends the transfer: DONE when every frame was handed over in time (the final frame
        carries `first_token`), else EXPIRED or FAILED (and the receiver is told to abort)."""
        entry = self._outgoing[request_id]
        try:
            in_flight = sum(n for n, done in entry.frames if not done())
            start = self.clock()
            if not self.transport.flush(max(0.0, entry.deadline - start)):
                self._try_send(abort_frame(request_id, "sender deadline passed", entry.token))
                return self._end(request_id, TransferState.EXPIRED)
            self.transport.send(done_frame(request_id, entry.num_pages, first_token, entry.token))
            self.meter.add(in_flight, self.clock() - start)
            return self._end(request_id, TransferState.DONE)
        except TransportError:
            return self._end(request_id, TransferState.FAILED)

    def abort(self, request_id: str, reason: str) -> TransferState:
        entry = self._outgoing.get(request_id)
        self._try_send(abort_frame(request_id, reason, entry.token if entry else ""))
        return self._end(request_id, TransferState.ABORTED)

    def _get(self, request_id: str) -> _Outgoing:
        entry = self._outgoing.get(request_id)
        if entry is None:
            raise ValueError(f"no transfer in progress for {request_id!r}")
        return entry

    def _send(self, entry: _Outgoing, frame: Frame, end_page: int) -> Callable[[], bool]:
        reusable = self.transport.send(frame)
        entry.frames.append((len(frame.payload), reusable))
        entry.progress.add(len(frame.payload), self.clock())
        entry.num_pages = max(entry.num_pages, end_page)
        return reusable

    def _end(self, request_id: str, state: TransferState) -> TransferState:
        entry = self._outgoing.pop(request_id, None)
        if entry is not None and self.observer is not None:
            self.observer(entry.progress.record("send", request_id, state, self.clock()))
        return state

    def _try_send(self, frame: Frame) -> None:
        try:
            self.transport.send(frame)
        except TransportError:
            pass  # the receiver's deadline ends the transfer on its side
