"""KV transfer from prefill to decode workers: one contract (base.py) over interchangeable
transports: an in-process twin (inproc.py) and ZMQ zero-copy frames (zmq_transport.py).
A torch.distributed (NCCL/gloo) transport arrives with the disaggregated-serving issue.
"""

from engine.kv_transfer.base import (
    BaseFrameReceiver,
    BaseFrameSender,
    Frame,
    KVReceiver,
    KVSender,
    TransferResult,
    TransferState,
    TransportError,
    poll,
)

__all__ = [
    "BaseFrameReceiver", "BaseFrameSender", "Frame", "KVReceiver", "KVSender", "TransferResult",
    "TransferState", "TransportError", "poll",
]
