"""KV frames over torch.distributed point-to-point: NCCL between GPUs, gloo on CPU (so the same
code is tested here). Every prefill and decode worker joins one process group at start-up;
a destination is `dist:<rank>`.

A frame crosses as three messages to the same rank: sizes (int64[2]), the msgpack header,
then the payload bytes. The receiver knows its sources (the prefill ranks) and posts receives
from each by name, one thread per source, queueing whole frames; per-source ordering keeps a
sender's three messages together. Receive-from-any-source is not used: NCCL rejects it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist

from engine.kv_transfer.frames import Frame, parse_header
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


class DistFrameSender(BaseFrameSender):
    def __init__(self, address: str, device: str = "cpu") -> None:
        self.dst = rank_of(address)
        self.device = device  # "cuda" for NCCL: tensors must live on the GPU

    def send(self, frame: Frame) -> Callable[[], bool]:
        header = msgpack.packb(frame.header, use_bin_type=True)
        payload = frame.payload
        try:
            dist.send(torch.tensor([len(header), len(payload)], dtype=torch.int64, device=self.device), self.dst)
            dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device), self.dst)
            if len(payload):
                dist.send(torch.frombuffer(payload, dtype=torch.uint8).to(self.device), self.dst)
        except RuntimeError as exc:
            raise TransportError(f"torch.distributed send to rank {self.dst} failed: {exc}") from exc
        return lambda: True  # dist.send returns once the bytes are out


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
        try:
            while True:
                sizes = torch.empty(2, dtype=torch.int64, device=self.device)
                dist.recv(sizes, src)
                header = torch.empty(int(sizes[0]), dtype=torch.uint8, device=self.device)
                dist.recv(header, src)
                payload: memoryview | bytes = b""
                if int(sizes[1]):
                    data = torch.empty(int(sizes[1]), dtype=torch.uint8, device=self.device)
                    dist.recv(data, src)
                    payload = data.cpu().numpy().data.cast("B")
                try:
                    self._frames.put(Frame(parse_header(header.cpu().numpy().tobytes()), payload))
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
