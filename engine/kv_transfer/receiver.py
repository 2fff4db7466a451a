"""The decode side of a KV transfer: the state machine that gives every transfer exactly one
terminal outcome.

Data flow: the decode worker reserves pages (handoff.py) and `expect`s the transfer with a
deadline (renewed by every page frame that lands); frames from the transport are fed to
`handle`, which writes page frames straight into the KV cache; `collect` reports each
transfer's outcome once: DONE, FAILED (bad frame or checksum), ABORTED (sender gave up),
EXPIRED (deadline passed). The owner then joins the request or cancels its reservation. One
`_Incoming` record per request id: ending a transfer is one deletion.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field

import torch

from engine.kv_cache import KVCache
from engine.kv_transfer.frames import (
    CorruptFrame,
    Frame,
    TransferObserver,
    TransferProgress,
    TransferResult,
    TransferState,
    page_checksum,
)
from engine.kv_transfer.transport import BaseFrameReceiver


@dataclass
class _Incoming:
    """One expected transfer on the receiving side."""

    page_ids: list[int]  # destination pages, in the order the sender indexes them
    token: str  # the transfer's secret: frames without it are not this transfer's
    timeout_s: float  # the lease: how long the transfer may go without a page arriving
    deadline: float  # clock() value; every page frame pushes it to now + timeout_s
    received: set[int] = field(default_factory=set)  # destination indexes written so far
    progress: TransferProgress = field(default_factory=TransferProgress)


class KVReceiver:
    """Receiver-side rules over any transport: `expect`, feed frames with `handle`, collect
    terminal outcomes with `collect` (each transfer reported exactly once)."""

    def __init__(self, kv_cache: KVCache, clock=time.monotonic, observer: TransferObserver | None = None,
                 require_checksum: bool = False) -> None:
        """`require_checksum`: a page frame without a CRC-32 fails its transfer."""
        self.kv_cache = kv_cache
        self.require_checksum = require_checksum
        self.clock = clock
        self.observer = observer
        self._incoming: dict[str, _Incoming] = {}
        self._outcomes: list[TransferResult] = []
        self.num_stray_frames = 0  # frames for transfers not (or no longer) expected

    def expect(self, request_id: str, page_ids: list[int], timeout_s: float, token: str = "") -> None:
        """`token`: a secret every frame of this transfer must carry (given to the sender through
        the reservation); a frame without it is ignored and counted, never able to end the transfer."""
        if request_id in self._incoming:
            raise ValueError(f"a transfer for {request_id!r} is already expected")
        self._incoming[request_id] = _Incoming(list(page_ids), token, timeout_s, self.clock() + timeout_s)

    def cancel(self, request_id: str) -> bool:
        """Stops expecting a transfer without reporting an outcome (its owner aborted it)."""
        entry = self._incoming.pop(request_id, None)
        if entry is not None and self.observer is not None:
            self.observer(entry.progress.record("receive", request_id, TransferState.ABORTED, self.clock()))
        return entry is not None

    def handle(self, frame: Frame) -> None:
        request_id = frame.header.get("request_id")
        entry = self._incoming.get(request_id) if isinstance(request_id, str) else None
        if request_id is None or entry is None or frame.header.get("token", "") != entry.token:
            self.num_stray_frames += 1  # not expected, or forged: the real transfer goes on
            return
        kind = frame.header.get("kind")
        try:
            if kind == "pages":
                self._write_pages(entry, frame)
            elif kind == "done":
                missing = set(range(len(entry.page_ids))) - entry.received
                if frame.header.get("num_pages") != len(entry.page_ids) or missing:
                    raise ValueError(f"done after {len(entry.received)} of {len(entry.page_ids)} pages")
                first_token = frame.header.get("first_token")
                if first_token is not None and (type(first_token) is not int or first_token < 0):
                    raise ValueError(f"done frame with a bad first token {first_token!r}")
                self._end(request_id, TransferState.DONE, first_token=first_token)
            elif kind == "abort":
                self._end(request_id, TransferState.ABORTED, str(frame.header.get("reason", "")))
            else:
                raise ValueError(f"unknown frame kind {kind!r}")
        except CorruptFrame as exc:  # counted apart: corruption on the wire, not a bad peer
            self._end(request_id, TransferState.FAILED, str(exc), reason="corrupt")
        except (ValueError, TypeError, KeyError, RuntimeError) as exc:  # this transfer fails, nothing else
            self._end(request_id, TransferState.FAILED, str(exc))

    def collect(self) -> list[TransferResult]:
        """Terminal outcomes since the last call, expiring transfers past their deadline."""
        now = self.clock()
        for request_id in [r for r, e in self._incoming.items() if e.deadline <= now]:
            self._end(request_id, TransferState.EXPIRED, "deadline passed")
        outcomes, self._outcomes = self._outcomes, []
        return outcomes

    @property
    def num_pending(self) -> int:
        return len(self._incoming)

    def request_ids(self) -> set[str]:
        """The requests whose KV is expected here (begun or announced) and not ended."""
        return set(self._incoming)

    def _write_pages(self, entry: _Incoming, frame: Frame) -> None:
        h = frame.header
        first, num = h.get("first_page"), h.get("num_pages")
        if type(first) is not int or type(num) is not int or num < 1:
            raise ValueError("a page frame needs int first_page and num_pages >= 1")
        if first < 0 or first + num > len(entry.page_ids):
            raise ValueError(f"pages [{first}, {first + num}) outside the {len(entry.page_ids)} reserved")
        if self.require_checksum and "crc32" not in h:
            raise CorruptFrame(f"pages [{first}, {first + num}) came without the required checksum")
        if "crc32" in h and page_checksum(h, frame.payload) != h["crc32"]:
            raise CorruptFrame(f"checksum mismatch in pages [{first}, {first + num})")
        # The frame must be exactly what this cache holds for `num` pages: dtype, shape and size.
        dtype, shape = self.kv_cache.dtype, self.kv_cache.pages_shape(num)
        if h.get("dtype") != str(dtype).removeprefix("torch.") or h.get("shape") != list(shape):
            raise ValueError(f"pages of {h.get('dtype')} {h.get('shape')}, this cache holds {dtype} {list(shape)}")
        if len(frame.payload) != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"page payload of {len(frame.payload)} bytes for shape {list(shape)}")
        # The payload is only read (copied into the cache), so a read-only buffer is fine.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(frame.payload, dtype=torch.uint8).view(dtype).view(h["shape"])
        self.kv_cache.write_pages(entry.page_ids[first : first + num], data)
        entry.received.update(range(first, first + num))
        now = self.clock()
        entry.progress.add(len(frame.payload), now)
        # A transfer that makes progress is alive: its lease covers the wait for the next page,
        # not the whole prefill (a long prompt streamed chunk by chunk never expires midway).
        entry.deadline = max(entry.deadline, now + entry.timeout_s)

    def _end(self, request_id: str, state: TransferState, detail: str = "", first_token: int | None = None,
             reason: str = "") -> None:
        entry = self._incoming.pop(request_id)
        self._outcomes.append(TransferResult(request_id, state, detail, first_token))
        if self.observer is not None:
            self.observer(entry.progress.record("receive", request_id, state, self.clock(), reason))


def poll(receiver: KVReceiver, transport: BaseFrameReceiver, timeout_s: float) -> list[TransferResult]:
    """Feeds whatever the transport has into the receiver; returns the terminal outcomes."""
    for frame in transport.recv(timeout_s):
        receiver.handle(frame)
    return receiver.collect()
