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

Idle links. Every gloo/NCCL receive is bounded by the group's timeout, and a receive that runs
past it ends that pair's connection for good (gloo closes it; the sender's next frame fails with
"Connection closed by peer"). A decode rank always has a receive posted on each source, so an
idle cluster would lose every link after one group timeout (120 s by default). So each sender's
thread sends a heartbeat (a preamble with no header and no payload, dropped by the receiver)
whenever it has sent nothing for `heartbeat_s`, which the config keeps well under the group
timeout (configs/cluster.py): no receive waits long enough to time out while its sender lives.
A link that dies anyway (the peer died, a stalled process, a desynchronised stream) is never
silent: the sender keeps the error and reports it (`link_error`), the receiver keeps one per
source (`link_errors`); the worker publishes both in its heartbeats and the router routes
around it (the pair's KV then goes over ZMQ: cluster/worker_host.py).

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
    every interface: engine/parallel/tcp_store.py). `timeout_s` bounds the join and every send
    and receive of the group (kv_transfer.dist_timeout_s): heartbeats keep idle links under it."""
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
DEFAULT_HEARTBEAT_S = 5.0  # kv_transfer.link_heartbeat_s


def encode_preamble(header: bytes, payload_len: int) -> torch.Tensor:
    """The first message of a frame: [PREAMBLE_BYTES] uint8. An empty header with no payload is
    a heartbeat (`heartbeat_preamble`)."""
    if len(header) > MAX_HEADER_BYTES:
        raise TransportError(f"frame header of {len(header)} bytes (at most {MAX_HEADER_BYTES})")
    preamble = torch.zeros(PREAMBLE_BYTES, dtype=torch.uint8)
    preamble[:16].view(torch.int64).copy_(torch.tensor([len(header), payload_len]))
    if header:
        preamble[16 : 16 + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    return preamble


def heartbeat_preamble() -> torch.Tensor:
    """What a sender sends when it has been idle: a preamble of no header and no payload."""
    return encode_preamble(b"", 0)


def decode_preamble(preamble: torch.Tensor) -> tuple[bytes, int]:
    """(header bytes, payload length) of a received preamble (a CPU tensor); (b"", 0) for a
    heartbeat. ValueError when the lengths are out of range, which leaves the stream from that
    rank unreadable."""
    header_len, payload_len = preamble[:16].view(torch.int64).tolist()
    if header_len == 0 and payload_len == 0:
        return b"", 0
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
    """Frames to one rank, sent in order by this sender's own thread: `send` queues and returns.
    The thread sends a heartbeat after `heartbeat_s` without a frame (module docstring)."""

    def __init__(self, address: str, device: str = "cpu", heartbeat_s: float = DEFAULT_HEARTBEAT_S) -> None:
        if not heartbeat_s > 0:
            raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s}")
        self.address = address
        self.dst = rank_of(address)
        self.device = device  # "cuda" for NCCL: tensors must live on the GPU
        self.heartbeat_s = heartbeat_s
        self.num_heartbeats = 0  # sent so far (tests read it)
        self._queue: queue.Queue[_Outgoing | None] = queue.Queue()
        self._last: _Outgoing | None = None
        self._error = ""  # why a send failed; the sender then refuses every frame
        self._thread = threading.Thread(target=self._send_forever, name=f"pdserve-kv-send-{self.dst}", daemon=True)
        self._thread.start()

    def link_error(self) -> str | None:
        return f"torch.distributed send to rank {self.dst} failed: {self._error}" if self._error else None

    def send(self, frame: Frame) -> Callable[[], bool]:
        if self._error:
            raise TransportError(self.link_error())
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
        heartbeat = heartbeat_preamble().to(self.device)
        while True:
            try:
                outgoing = self._queue.get(timeout=self.heartbeat_s)
            except queue.Empty:  # idle: keep the peer's posted receive under the group timeout
                if not self._error and self._send_tensors([heartbeat]):
                    self.num_heartbeats += 1
                continue
            if outgoing is None:
                return
            if not self._error:
                self._send_tensors(outgoing.tensors)
            outgoing.tensors.clear()  # the memory is free either way
            outgoing.sent.set()

    def _send_tensors(self, tensors: list[torch.Tensor]) -> bool:
        try:
            for tensor in tensors:
                dist.send(tensor, self.dst)
            return True
        except RuntimeError as exc:  # the peer or the group is gone: the link is down for good
            self._error = str(exc)[:500]
            log.warning("KV link to rank %s is down (send failed): %s", self.dst, self._error)
            return False


class DistFrameReceiver(BaseFrameReceiver):
    def __init__(self, sources: tuple[int, ...] | list[int], device: str = "cpu") -> None:
        """`sources`: the ranks that send KV here (every prefill worker of the group)."""
        rank = dist.get_rank()
        if not sources or rank in sources or not all(0 <= s < dist.get_world_size() for s in sources):
            raise ValueError(f"KV sources {list(sources)} must be other ranks of the group of "
                             f"{dist.get_world_size()} (this is rank {rank})")
        self.device = device
        self.address = address_of(rank)
        self.num_heartbeats = 0  # received so far, from every source (tests read it)
        self._frames: queue.Queue[Frame] = queue.Queue()
        self._errors: dict[int, str] = {}  # source rank -> why its link is down (its thread ended)
        self._closing = False
        self._threads = [threading.Thread(target=self._receive_forever, args=(src,), name=f"pdserve-kv-recv-{src}",
                                          daemon=True) for src in sources]
        for thread in self._threads:
            thread.start()

    def link_errors(self) -> dict[str, str]:
        """The sources whose link is down (`dist:<rank>` -> why): their receive thread ended."""
        return {address_of(src): why for src, why in dict(self._errors).items()}

    def close(self) -> None:
        self._closing = True  # the receive threads end with the group (leave_group): not a link failure

    def _receive_forever(self, src: int) -> None:
        use_device(self.device)
        try:
            while True:
                preamble = torch.empty(PREAMBLE_BYTES, dtype=torch.uint8, device=self.device)
                dist.recv(preamble, src)
                try:
                    header_bytes, payload_len = decode_preamble(preamble.cpu())
                except ValueError as exc:  # the byte stream from src is lost: stop reading it
                    self._down(src, f"unreadable stream: {exc}")
                    return
                if not header_bytes:
                    self.num_heartbeats += 1
                    continue
                payload: memoryview | bytes = b""
                if payload_len:
                    data = torch.empty(payload_len, dtype=torch.uint8, device=self.device)
                    dist.recv(data, src)
                    payload = data.cpu().numpy().data.cast("B")
                try:
                    self._frames.put(Frame(parse_header(header_bytes), payload))
                except ValueError as exc:  # one bad frame is dropped, never the receiver
                    log.warning("dropped a bad KV frame from rank %s: %s", src, exc)
        except RuntimeError as exc:  # the group was torn down (stopping), or the link died
            if self._closing:
                log.info("KV receiver stopped: %s", exc)
            else:
                self._down(src, f"receive failed: {str(exc)[:500]}")

    def _down(self, src: int, why: str) -> None:
        self._errors[src] = why
        log.error("KV link from rank %s is down: %s", src, why)

    def recv(self, timeout_s: float) -> list[Frame]:
        frames = []
        try:
            frames.append(self._frames.get(timeout=timeout_s) if timeout_s > 0 else self._frames.get_nowait())
            while True:
                frames.append(self._frames.get_nowait())
        except queue.Empty:
            pass
        return frames
