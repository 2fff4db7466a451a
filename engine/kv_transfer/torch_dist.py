"""KV frames over torch.distributed point-to-point: NCCL between GPUs, gloo on CPU (so the same
code is tested here). Every prefill and decode worker joins one process group at start-up;
a destination is `dist:<rank>`.

A frame crosses as two messages to the same rank: a fixed-size preamble (header and payload
lengths, then the msgpack header, PREAMBLE_BYTES in all) and, when there is one, the payload.
`send` queues the frame for the sender's own thread and returns at once, so the prefill step
loop is never held by a decode rank that has not posted its receive yet (a blocking send of
pages waits for exactly that); the tensors stay referenced until their messages have left,
which the callable `send` returns (and `flush`) report. A thread and blocking sends rather than
`isend` on the step thread: gloo's send work reports completion only once waited on, and a
timed wait that expires closes the connection to that peer (both seen on torch 2.13). Not
`batch_isend_irecv` either: on NCCL a coalesced batch that is a group's first p2p call must
include every rank, a hang that cannot be ruled out without GPUs.
The receiver knows its sources (the prefill ranks) and posts receives from each by name, one
thread per source, queueing whole frames; per-source ordering keeps a sender's two messages
together. Receive-from-any-source is not used: NCCL rejects it.

Not done yet (issue 12): the payload still reaches this module as host bytes (frames.py
`pages_frame`), so on GPUs pages go device -> host -> device on each side; sending the device
pages themselves needs a frame that carries a tensor. The NCCL path has never run on a GPU.
"""

from __future__ import annotations

import logging
import queue
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist

from engine.kv_transfer.frames import MAX_FRAME_BYTES, MAX_HEADER_BYTES, Frame, parse_header
from engine.kv_transfer.transport import BaseFrameReceiver, BaseFrameSender, TransportError
from engine.parallel.tcp_store import open_tcp_store

log = logging.getLogger(__name__)
PREFIX = "dist:"


def join_group(rank: int, world_size: int, store_address: str, backend: str = "gloo", timeout_s: float = 120) -> None:
    """Joins the KV process group (blocks until every rank has joined). Rank 0 hosts the group's
    store, listening on store_address's host only (an `init_method="tcp://..."` store listens on
    every interface: engine/parallel/tcp_store.py)."""
    if not dist.is_initialized():
        host, port = store_address.rsplit(":", 1)
        store = open_tcp_store(host, int(port), world_size, rank == 0, timeout_s)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def address_of(rank: int) -> str:
    return f"{PREFIX}{rank}"


def rank_of(address: str) -> int:
    if not address.startswith(PREFIX):
        raise ValueError(f"{address!r} is not a torch.distributed KV address ({PREFIX}<rank>)")
    return int(address[len(PREFIX) :])


PREAMBLE_BYTES = 16 + MAX_HEADER_BYTES  # int64 header length, int64 payload length, header


def encode_preamble(header: bytes, payload_len: int) -> torch.Tensor:
    """The first message of a frame: [PREAMBLE_BYTES] uint8."""
    if len(header) > MAX_HEADER_BYTES:
        raise TransportError(f"frame header of {len(header)} bytes (at most {MAX_HEADER_BYTES})")
    preamble = torch.zeros(PREAMBLE_BYTES, dtype=torch.uint8)
    preamble[:16].view(torch.int64).copy_(torch.tensor([len(header), payload_len]))
    preamble[16 : 16 + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    return preamble


def decode_preamble(preamble: torch.Tensor) -> tuple[bytes, int]:
    """(header bytes, payload length) of a received preamble (a CPU tensor); ValueError when
    the lengths are out of range, which leaves the stream from that rank unreadable."""
    header_len, payload_len = preamble[:16].view(torch.int64).tolist()
    if not 0 < header_len <= MAX_HEADER_BYTES or not 0 <= payload_len <= MAX_FRAME_BYTES:
        raise ValueError(f"frame preamble with header {header_len} / payload {payload_len} bytes")
    return preamble[16 : 16 + header_len].numpy().tobytes(), payload_len


def use_device(device: str) -> None:
    """Makes `device` this thread's current CUDA device (a new thread starts on device 0, which
    NCCL would use for its stream); nothing for CPU or an unindexed "cuda" (device 0 of the
    GPUs this process sees, as Ray hands them out). Unverified on GPUs so far."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)


@dataclass
class _Outgoing:
    """One frame on its way: the tensors its messages read (kept alive until sent) and the event
    the sending thread sets once they have left, or failed to."""

    tensors: list[torch.Tensor]
    sent: threading.Event = field(default_factory=threading.Event)


class DistFrameSender(BaseFrameSender):
    """Frames to one rank, sent in order by this sender's own thread: `send` queues and returns."""

    def __init__(self, address: str, device: str = "cpu") -> None:
        self.dst = rank_of(address)
        self.device = device  # "cuda" for NCCL: tensors must live on the GPU
        self._queue: queue.Queue[_Outgoing | None] = queue.Queue()
        self._last: _Outgoing | None = None
        self._error = ""  # why a send failed; the sender then refuses every frame
        self._thread = threading.Thread(target=self._send_forever, name=f"pdserve-kv-send-{self.dst}", daemon=True)
        self._thread.start()

    def send(self, frame: Frame) -> Callable[[], bool]:
        if self._error:
            raise TransportError(f"torch.distributed send to rank {self.dst} failed: {self._error}")
        header = msgpack.packb(frame.header, use_bin_type=True)
        tensors = [encode_preamble(header, len(frame.payload)).to(self.device)]
        if len(frame.payload):
            with warnings.catch_warnings():  # a read-only payload is only read by the send
                warnings.simplefilter("ignore", UserWarning)
                tensors.append(torch.frombuffer(frame.payload, dtype=torch.uint8).to(self.device))
        outgoing = _Outgoing(tensors)
        self._queue.put(outgoing)
        self._last = outgoing
        return outgoing.sent.is_set

    def flush(self, timeout_s: float) -> bool:
        """Waits until every frame queued so far has left; False at the deadline or after a
        failed send. The wait is on this side's event, never a timed gloo/NCCL wait: gloo
        closes the connection to a peer whose wait timed out (seen with torch 2.13)."""
        last = self._last
        done = last is None or last.sent.wait(max(0.0, timeout_s))
        return done and not self._error

    def close(self) -> None:
        self._queue.put(None)  # a send blocked on a dead peer keeps the (daemon) thread

    def _send_forever(self) -> None:
        use_device(self.device)
        while (outgoing := self._queue.get()) is not None:
            try:
                if not self._error:
                    for tensor in outgoing.tensors:
                        dist.send(tensor, self.dst)
            except RuntimeError as exc:  # the peer or the group is gone
                self._error = str(exc)
                log.warning("KV send to rank %s failed: %s", self.dst, exc)
            outgoing.tensors.clear()  # the memory is free either way
            outgoing.sent.set()


class DistFrameReceiver(BaseFrameReceiver):
    def __init__(self, sources: tuple[int, ...] | list[int], device: str = "cpu") -> None:
        """`sources`: the ranks that send KV here (every prefill worker of the group)."""
        rank = dist.get_rank()
        if not sources or rank in sources or not all(0 <= s < dist.get_world_size() for s in sources):
            raise ValueError(f"KV sources {list(sources)} must be other ranks of the group of "
                             f"{dist.get_world_size()} (this is rank {rank})")
        self.device = device
        self.address = address_of(rank)
        self._frames: queue.Queue[Frame] = queue.Queue()
        self._threads = [threading.Thread(target=self._receive_forever, args=(src,), name=f"pdserve-kv-recv-{src}",
                                          daemon=True) for src in sources]
        for thread in self._threads:
            thread.start()

    def _receive_forever(self, src: int) -> None:
        use_device(self.device)
        try:
            while True:
                preamble = torch.empty(PREAMBLE_BYTES, dtype=torch.uint8, device=self.device)
                dist.recv(preamble, src)
                try:
                    header_bytes, payload_len = decode_preamble(preamble.cpu())
                except ValueError as exc:  # the byte stream from src is lost: stop reading it
                    log.error("KV receiver stops reading rank %s: %s", src, exc)
                    return
                payload: memoryview | bytes = b""
                if payload_len:
                    data = torch.empty(payload_len, dtype=torch.uint8, device=self.device)
                    dist.recv(data, src)
                    payload = data.cpu().numpy().data.cast("B")
                try:
                    self._frames.put(Frame(parse_header(header_bytes), payload))
                except ValueError as exc:  # one bad frame is dropped, never the receiver
                    log.warning("dropped a bad KV frame from rank %s: %s", src, exc)
        except RuntimeError as exc:  # the group was torn down: the worker is stopping
            log.info("KV receiver stopped: %s", exc)

    def recv(self, timeout_s: float) -> list[Frame]:
        frames = []
        try:
            frames.append(self._frames.get(timeout=timeout_s) if timeout_s > 0 else self._frames.get_nowait())
            while True:
                frames.append(self._frames.get_nowait())
        except queue.Empty:
            pass
        return frames
