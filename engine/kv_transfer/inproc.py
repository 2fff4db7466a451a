"""In-process twin of the KV transport: frames go through a queue, bytes are copied as a
socket would, so the same sender/receiver rules are tested without sockets."""

from __future__ import annotations

import queue
from collections.abc import Callable

from engine.kv_transfer.frames import Frame
from engine.kv_transfer.transport import BaseFrameReceiver, BaseFrameSender


class InProcChannel:
    """One sender -> one receiver pipe; `corrupt` flips a payload byte (tests of checksums)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Frame] = queue.Queue()
        self.sender = _Sender(self)
        self.receiver = _Receiver(self)
        self.corrupt_next_payload = False


class _Sender(BaseFrameSender):
    def __init__(self, channel: InProcChannel) -> None:
        self.channel = channel

    def send(self, frame: Frame) -> Callable[[], bool]:
        payload = bytes(frame.payload)  # the receiver must never see the sender's memory
        if self.channel.corrupt_next_payload and payload:
            payload = bytes([payload[0] ^ 0xFF]) + payload[1:]
            self.channel.corrupt_next_payload = False
        self.channel._queue.put(Frame(dict(frame.header), payload))
        return lambda: True  # copied above: the sender's buffer is free at once


class _Receiver(BaseFrameReceiver):
    def __init__(self, channel: InProcChannel) -> None:
        self.channel = channel

    def recv(self, timeout_s: float) -> list[Frame]:
        frames = []
        try:
            frames.append(self.channel._queue.get(timeout=timeout_s))
            while True:
                frames.append(self.channel._queue.get_nowait())
        except queue.Empty:
            pass
        return frames
