"""The KV-transfer contract: what crosses from a prefill worker to a decode worker, and the
state machine that gives every transfer exactly one terminal outcome on the receiving side.

Data flow: the decode side reserves pages (engine/kv_handoff.py) and `expect`s the transfer
with a deadline; the prefill side sends page frames as its KV becomes ready, then `done` (or
`abort`); the receiver writes each frame straight into its KV cache and, on `poll`, reports
each transfer's outcome once: DONE, FAILED (bad frame or checksum), ABORTED (sender gave up),
EXPIRED (deadline passed). The owner then joins the request or cancels its reservation.
Transports (inproc.py, zmq_transport.py) only move `Frame`s; this module owns the rules.
Frames are a msgpack-able header dict plus raw bytes: nothing is pickled. Each side may be
given an observer that hears one `TransferRecord` per transfer when it ends (live metrics).
"""

from __future__ import annotations

import enum
import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.kv_cache import KVCache


class TransferState(str, enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"
    EXPIRED = "expired"


@dataclass(frozen=True)
class Frame:
    """One message: a header (str keys, msgpack types) and an optional payload."""

    header: dict[str, Any]
    payload: memoryview | bytes = b""


def pages_frame(request_id: str, first_page: int, data: torch.Tensor, checksum: bool) -> Frame:
    """Frame for `data` = KVCache.read_pages output, to land at destination index `first_page`."""
    raw = data.contiguous().view(torch.uint8).numpy()  # bf16 travels as bytes too
    header = {
        "kind": "pages", "request_id": request_id, "first_page": first_page,
        "num_pages": int(data.shape[2]), "dtype": str(data.dtype).removeprefix("torch."),
        "shape": list(data.shape),
    }
    if checksum:
        header["crc32"] = zlib.crc32(raw)
    return Frame(header, memoryview(raw).cast("B"))


def done_frame(request_id: str, num_pages: int) -> Frame:
    return Frame({"kind": "done", "request_id": request_id, "num_pages": num_pages})


def abort_frame(request_id: str, reason: str) -> Frame:
    return Frame({"kind": "abort", "request_id": request_id, "reason": reason})


@dataclass
class _Expected:
    page_ids: list[int]  # destination pages, in the order the sender indexes them
    deadline: float  # time.monotonic() value
    received: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class TransferResult:
    request_id: str
    state: TransferState
    detail: str = ""


@dataclass(frozen=True)
class TransferRecord:
    """One ended transfer as one side saw it: what live metrics count."""

    side: str  # "send" or "receive"
    request_id: str
    state: TransferState
    num_bytes: int  # page payload bytes handed to (sender) or written from (receiver) the transport
    duration_s: float  # first page frame -> the end (0 when no page moved, e.g. all cached)


TransferObserver = Callable[[TransferRecord], None]


@dataclass
class _Progress:
    """Bytes and the first frame's time of one transfer, for its TransferRecord."""

    num_bytes: int = 0
    first_frame_at: float | None = None

    def add(self, num_bytes: int, now: float) -> None:
        self.num_bytes += num_bytes
        if self.first_frame_at is None:
            self.first_frame_at = now

    def record(self, side: str, request_id: str, state: TransferState, now: float) -> TransferRecord:
        return TransferRecord(side, request_id, state, self.num_bytes,
                              0.0 if self.first_frame_at is None else now - self.first_frame_at)


class KVReceiver:
    """Receiver-side rules over any transport: `expect`, feed frames with `handle`, collect
    terminal outcomes with `collect` (each transfer reported exactly once)."""

    def __init__(self, kv_cache: KVCache, clock=time.monotonic, observer: TransferObserver | None = None) -> None:
        self.kv_cache = kv_cache
        self.clock = clock
        self.observer = observer
        self._expected: dict[str, _Expected] = {}
        self._outcomes: list[TransferResult] = []
        self._progress: dict[str, _Progress] = {}
        self.num_stray_frames = 0  # frames for transfers not (or no longer) expected

    def expect(self, request_id: str, page_ids: list[int], timeout_s: float) -> None:
        if request_id in self._expected:
            raise ValueError(f"a transfer for {request_id!r} is already expected")
        self._expected[request_id] = _Expected(list(page_ids), self.clock() + timeout_s)
        self._progress[request_id] = _Progress()

    def cancel(self, request_id: str) -> bool:
        """Stops expecting a transfer without reporting an outcome (its owner aborted it)."""
        progress = self._progress.pop(request_id, None)
        if progress is not None and self.observer is not None:
            self.observer(progress.record("receive", request_id, TransferState.ABORTED, self.clock()))
        return self._expected.pop(request_id, None) is not None

    def handle(self, frame: Frame) -> None:
        request_id = frame.header.get("request_id")
        entry = self._expected.get(request_id)
        if entry is None:
            self.num_stray_frames += 1
            return
        kind = frame.header.get("kind")
        try:
            if kind == "pages":
                self._write_pages(entry, frame)
            elif kind == "done":
                missing = set(range(len(entry.page_ids))) - entry.received
                if frame.header.get("num_pages") != len(entry.page_ids) or missing:
                    raise ValueError(f"done after {len(entry.received)} of {len(entry.page_ids)} pages")
                self._end(request_id, TransferState.DONE)
            elif kind == "abort":
                self._end(request_id, TransferState.ABORTED, str(frame.header.get("reason", "")))
            else:
                raise ValueError(f"unknown frame kind {kind!r}")
        except (ValueError, TypeError, KeyError) as exc:
            self._end(request_id, TransferState.FAILED, str(exc))

    def collect(self) -> list[TransferResult]:
        """Terminal outcomes since the last call, expiring transfers past their deadline."""
        now = self.clock()
        for request_id in [r for r, e in self._expected.items() if e.deadline <= now]:
            self._end(request_id, TransferState.EXPIRED, "deadline passed")
        outcomes, self._outcomes = self._outcomes, []
        return outcomes

    @property
    def num_pending(self) -> int:
        return len(self._expected)

    def _write_pages(self, entry: _Expected, frame: Frame) -> None:
        h = frame.header
        first, num = int(h["first_page"]), int(h["num_pages"])
        if first < 0 or first + num > len(entry.page_ids):
            raise ValueError(f"pages [{first}, {first + num}) outside the {len(entry.page_ids)} reserved")
        if "crc32" in h and zlib.crc32(frame.payload) != h["crc32"]:
            raise ValueError(f"checksum mismatch in pages [{first}, {first + num})")
        dtype = getattr(torch, h["dtype"])
        # The payload is only read (copied into the cache), so a read-only buffer is fine.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(frame.payload, dtype=torch.uint8).view(dtype).view(h["shape"])
        self.kv_cache.write_pages(entry.page_ids[first : first + num], data)
        entry.received.update(range(first, first + num))
        self._progress[h["request_id"]].add(len(frame.payload), self.clock())

    def _end(self, request_id: str, state: TransferState, detail: str = "") -> None:
        del self._expected[request_id]
        self._outcomes.append(TransferResult(request_id, state, detail))
        progress = self._progress.pop(request_id)
        if self.observer is not None:
            self.observer(progress.record("receive", request_id, state, self.clock()))


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

    def close(self) -> None:
        pass


class BaseFrameReceiver:
    def recv(self, timeout_s: float) -> list[Frame]:
        """Frames that arrived, waiting up to timeout_s for the first one."""
        raise NotImplementedError

    def close(self) -> None:
        pass


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


class KVSender:
    """Sender-side rules: a transfer is sent page frames, then ends in exactly one state. The
    prefill worker releases its held KV after `finish` or `abort`, whatever the outcome."""

    def __init__(self, transport: BaseFrameSender, checksum: bool = False, clock=time.monotonic,
                 observer: TransferObserver | None = None) -> None:
        self.transport = transport
        self.checksum = checksum
        self.clock = clock
        self.observer = observer
        self._progress: dict[str, _Progress] = {}
        self.staging = StagingBuffers()
        self._deadlines: dict[str, float] = {}
        self._num_pages: dict[str, int] = {}

    def begin(self, request_id: str, timeout_s: float) -> None:
        if request_id in self._deadlines:
            raise ValueError(f"a transfer for {request_id!r} is already in progress")
        self._deadlines[request_id] = self.clock() + timeout_s
        self._num_pages[request_id] = 0
        self._progress[request_id] = _Progress()

    def send_pages(self, request_id: str, first_page: int, data: torch.Tensor) -> None:
        """Sends pages [first_page, first_page + n) of the destination list (data: read_pages)."""
        if request_id not in self._deadlines:
            raise ValueError(f"no transfer in progress for {request_id!r}")
        frame = pages_frame(request_id, first_page, data, self.checksum)
        self.transport.send(frame)
        self._progress[request_id].add(len(frame.payload), self.clock())
        self._num_pages[request_id] = max(self._num_pages[request_id], first_page + int(data.shape[2]))

    def send_cache_pages(self, request_id: str, first_page: int, kv_cache: KVCache, page_ids: list[int]) -> None:
        """send_pages for pages read straight from a cache, through a recycled staging buffer."""
        if request_id not in self._deadlines:
            raise ValueError(f"no transfer in progress for {request_id!r}")
        buf = self.staging.acquire(kv_cache.pages_shape(len(page_ids)), kv_cache.dtype, kv_cache.device)
        kv_cache.read_pages(page_ids, out=buf)
        frame = pages_frame(request_id, first_page, buf, self.checksum)
        reusable = self.transport.send(frame)
        self._progress[request_id].add(len(frame.payload), self.clock())
        self.staging.release(buf, reusable)
        self._num_pages[request_id] = max(self._num_pages[request_id], first_page + len(page_ids))

    def finish(self, request_id: str) -> TransferState:
        """Ends the transfer: DONE when every frame was handed over in time, else EXPIRED or
        FAILED (and the receiver is told to abort)."""
        deadline = self._deadlines.pop(request_id)
        num_pages = self._num_pages.pop(request_id)
        try:
            if not self.transport.flush(max(0.0, deadline - self.clock())):
                self._try_send(abort_frame(request_id, "sender deadline passed"))
                return self._ended(request_id, TransferState.EXPIRED)
            self.transport.send(done_frame(request_id, num_pages))
            return self._ended(request_id, TransferState.DONE)
        except TransportError:
            return self._ended(request_id, TransferState.FAILED)

    def abort(self, request_id: str, reason: str) -> TransferState:
        self._deadlines.pop(request_id, None)
        self._num_pages.pop(request_id, None)
        self._try_send(abort_frame(request_id, reason))
        return self._ended(request_id, TransferState.ABORTED)

    def _ended(self, request_id: str, state: TransferState) -> TransferState:
        progress = self._progress.pop(request_id, None)
        if progress is not None and self.observer is not None:
            self.observer(progress.record("send", request_id, state, self.clock()))
        return state

    def _try_send(self, frame: Frame) -> None:
        try:
            self.transport.send(frame)
        except TransportError:
            pass  # the receiver's deadline ends the transfer on its side


def poll(receiver: KVReceiver, transport: BaseFrameReceiver, timeout_s: float) -> list[TransferResult]:
    """Feeds whatever the transport has into the receiver; returns the terminal outcomes."""
    for frame in transport.recv(timeout_s):
        receiver.handle(frame)
    return receiver.collect()
