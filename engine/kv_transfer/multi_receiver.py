"""One decode worker's KV frames from more than one transport: on the torch_dist transport the
worker also binds its ZMQ KV port, so a prefill->decode pair whose torch.distributed link died
(engine/kv_transfer/torch_dist.py) sends its KV over ZMQ instead (the router picks the address
from the links the workers report: router/worker_pool.py). The frames of both go into the same
KVReceiver (receiver.py): a transfer's token and deadline do not depend on how it travels.
"""

from __future__ import annotations

import time

from engine.kv_transfer.frames import Frame
from engine.kv_transfer.transport import BaseFrameReceiver

POLL_SLICE_S = 0.001  # while waiting, each transport is looked at this often


class MultiFrameReceiver(BaseFrameReceiver):
    def __init__(self, primary: BaseFrameReceiver, *others: BaseFrameReceiver) -> None:
        """`primary`: where frames normally come from (its address is the worker's KV address)."""
        self.receivers = (primary, *others)
        self.address = getattr(primary, "address", "")

    def recv(self, timeout_s: float) -> list[Frame]:
        """What every transport holds now; with none, waits up to timeout_s, looking at each in
        turn every POLL_SLICE_S (a decode worker waits only while a transfer is pending and
        nothing runs, cluster/serving_loop.py, so the slices cost nothing under load)."""
        deadline = time.monotonic() + timeout_s
        while True:
            frames = [frame for receiver in self.receivers for frame in receiver.recv(0.0)]
            remaining = deadline - time.monotonic()
            if frames or remaining <= 0:
                return frames
            frames = self.receivers[0].recv(min(POLL_SLICE_S, remaining))
            if frames:
                return frames + [frame for receiver in self.receivers[1:] for frame in receiver.recv(0.0)]

    def link_errors(self) -> dict[str, str]:
        errors: dict[str, str] = {}
        for receiver in self.receivers:
            errors.update(receiver.link_errors())
        return errors

    def close(self) -> None:
        for receiver in self.receivers:
            receiver.close()
