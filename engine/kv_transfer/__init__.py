"""KV transfer from prefill to decode workers: the wire format and outcomes (frames.py), the
transport seam (transport.py) with an in-process twin (inproc.py), ZMQ zero-copy frames
(zmq_transport.py) and torch.distributed (torch_dist.py); the sender's and receiver's rules
(sender.py, receiver.py); and the decode side's page reservations (handoff.py).
"""

from engine.kv_transfer.frames import Frame, TransferObserver, TransferRecord, TransferResult, TransferState
from engine.kv_transfer.receiver import KVReceiver, poll
from engine.kv_transfer.sender import KVSender
from engine.kv_transfer.transport import BaseFrameReceiver, BaseFrameSender, TransportError

__all__ = [
    "BaseFrameReceiver", "BaseFrameSender", "Frame", "KVReceiver", "KVSender", "TransferObserver", "TransferRecord",
    "TransferResult", "TransferState", "TransportError", "poll",
]
