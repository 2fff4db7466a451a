"""What crosses from a prefill worker to a decode worker, and what a transfer ends as.

A `Frame` is a msgpack-able header dict plus raw bytes (nothing is pickled): page frames carry
KV pages (`KVCache.read_pages` layout) for destination indexes [first_page, first_page + n),
then one `done` or `abort` frame ends the transfer. Transports (transport.py) move frames; the
sender (sender.py) and receiver (receiver.py) own the rules; each ended transfer is one
`TransferResult` for its owner and one `TransferRecord` for live metrics.
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import torch


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


MAX_HEADER_BYTES = 4096  # a page frame's header is ~150 bytes
# The largest frame payload a decode worker takes: 8 pages of a 70B-class model are ~40 MiB.
MAX_FRAME_BYTES = 256 << 20
FRAME_KINDS = ("pages", "done", "abort")


def parse_header(data: bytes) -> dict[str, Any]:
    """A received frame's header: a msgpack map with a known `kind` and a string `request_id`;
    ValueError for anything else (the transport drops and counts it, the receiver never sees it)."""
    if len(data) > MAX_HEADER_BYTES:
        raise ValueError(f"frame header of {len(data)} bytes (at most {MAX_HEADER_BYTES})")
    try:
        header = msgpack.unpackb(data, raw=False)
    except (ValueError, TypeError, RecursionError, msgpack.UnpackException) as exc:
        raise ValueError(f"frame header is not msgpack: {exc}") from None
    if not isinstance(header, dict) or header.get("kind") not in FRAME_KINDS:
        raise ValueError(f"not a KV frame header: {str(header)[:80]}")
    request_id = header.get("request_id")
    if not isinstance(request_id, str) or not 0 < len(request_id) <= 256:
        raise ValueError("KV frame without a request id of 1-256 characters")
    return header


def page_checksum(header: dict[str, Any], payload: memoryview | bytes) -> int:
    """CRC-32 over a page frame's payload and the header fields that say where it lands, so a
    frame whose bytes or destination were changed on the way fails its transfer."""
    where = f"{header['request_id']}:{header['first_page']}:{header['num_pages']}:{header.get('token', '')}"
    return zlib.crc32(payload, zlib.crc32(where.encode()))


def host_bytes(data: torch.Tensor) -> memoryview:
    """The tensor's bytes in host memory (bf16 travels as bytes too): a view of a contiguous CPU
    tensor, a copy of a GPU one (`.numpy()` refuses device memory)."""
    if data.device.type != "cpu":
        data = data.cpu()
    return data.contiguous().view(torch.uint8).numpy().data


def pages_frame(request_id: str, first_page: int, data: torch.Tensor, checksum: bool, token: str = "") -> Frame:
    """Frame for `data` = KVCache.read_pages output, to land at destination index `first_page`.
    `token`: the transfer's secret from its reservation (the receiver ignores frames without it)."""
    raw = host_bytes(data)
    header: dict[str, Any] = {
        "kind": "pages", "request_id": request_id, "first_page": first_page,
        "num_pages": int(data.shape[2]), "dtype": str(data.dtype).removeprefix("torch."),
        "shape": list(data.shape),
    }
    if token:
        header["token"] = token
    if checksum:
        header["crc32"] = page_checksum(header, raw)
    return Frame(header, raw.cast("B"))


def done_frame(request_id: str, num_pages: int, first_token: int | None = None, token: str = "") -> Frame:
    """The transfer's final frame; it carries the first token so the decode side can join the
    request the moment its KV is whole (no second message from the router)."""
    header: dict[str, Any] = {"kind": "done", "request_id": request_id, "num_pages": num_pages}
    if first_token is not None:
        header["first_token"] = first_token
    if token:
        header["token"] = token
    return Frame(header)


def abort_frame(request_id: str, reason: str, token: str = "") -> Frame:
    header = {"kind": "abort", "request_id": request_id, "reason": reason}
    if token:
        header["token"] = token
    return Frame(header)


@dataclass(frozen=True)
class TransferResult:
    request_id: str
    state: TransferState
    detail: str = ""
    first_token: int | None = None  # DONE: the token the prefill side sampled, when it sent one


@dataclass(frozen=True)
class TransferRecord:
    """One ended transfer as one side saw it: what live metrics count."""

    side: str  # "send" or "receive"
    request_id: str
    state: TransferState
    num_bytes: int  # page payload bytes handed to (sender) or written from (receiver) the transport
    duration_s: float  # first page frame -> the end (0 when no page moved, e.g. all cached)
    reason: str = ""  # why it did not end DONE: "corrupt" (a checksum failed or was missing), else the state

    @property
    def failure_reason(self) -> str:
        return self.reason or self.state.value


class CorruptFrame(ValueError):
    """A page frame whose checksum is missing (where required) or does not match its bytes."""


TransferObserver = Callable[[TransferRecord], None]


@dataclass
class TransferProgress:
    """Bytes and the first frame's time of one transfer, for its TransferRecord."""

    num_bytes: int = 0
    first_frame_at: float | None = None

    def add(self, num_bytes: int, now: float) -> None:
        self.num_bytes += num_bytes
        if self.first_frame_at is None:
            self.first_frame_at = now

    def record(self, side: str, request_id: str, state: TransferState, now: float, reason: str = "") -> TransferRecord:
        return TransferRecord(side, request_id, state, self.num_bytes,
                              0.0 if self.first_frame_at is None else now - self.first_frame_at, reason)
