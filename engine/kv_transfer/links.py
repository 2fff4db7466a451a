"""A prefill worker's KV links: one `KVSender` per decode endpoint it sends to, and what state
each link is in, for the worker's heartbeats.

Owned by the prefill worker's serving thread (ZMQ sockets are thread-confined), made by the
process that hosts it (cluster/worker_host.py) with a factory of frame senders for the
configured transport. A link is opened on first use, or ahead (`keep`) for every destination
the worker may be asked to send to: an open link carries heartbeats (torch_dist, ZMTP pings)
from the start, so one that dies is seen dead before a request needs it, and the router, told
by the heartbeats (`states`), routes around it. A link whose destination left the cluster is
closed once no transfer of its own is in progress.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine.kv_transfer.frames import TransferObserver
from engine.kv_transfer.sender import KVSender
from engine.kv_transfer.transport import BaseFrameSender

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LinkState:
    """One link as its sender sees it: `error` is None while it can carry frames."""

    address: str
    error: str | None = None
    bytes_per_s: float = 0.0  # measured on its transfers (link_meter.py); 0 = not yet
    latency_s: float = 0.0

    @property
    def up(self) -> bool:
        return self.error is None


class KVLinks:
    def __init__(self, open_frames: Callable[[str], BaseFrameSender], checksum: bool = False,
                 observer: TransferObserver | None = None) -> None:
        """`open_frames(address)`: a frame sender to one decode endpoint (the transport's)."""
        self._open_frames = open_frames
        self.checksum = checksum
        self.observer = observer
        self._senders: dict[str, KVSender] = {}
        self._reported: dict[str, str | None] = {}  # the last state logged per link

    def sender(self, address: str) -> KVSender:
        """The link to `address`, opened now if it is not open (one connection per endpoint)."""
        if address not in self._senders:
            self._senders[address] = KVSender(self._open_frames(address), checksum=self.checksum,
                                              observer=self.observer)
        return self._senders[address]

    def request_ids(self) -> set[str]:
        """The requests with a transfer in progress on any link."""
        return set().union(*(s.request_ids() for s in self._senders.values()))

    def keep(self, addresses: Iterable[str]) -> None:
        """Opens a link to each of `addresses` and closes the idle ones to any other endpoint."""
        wanted = set(addresses)
        for address in sorted(wanted - set(self._senders)):
            self.sender(address)
        for address in [a for a, s in self._senders.items() if a not in wanted and not s.num_in_progress]:
            self._senders.pop(address).transport.close()
            self._reported.pop(address, None)

    def states(self) -> tuple[LinkState, ...]:
        """Every open link's state, now; a change is logged once (on the sending thread)."""
        states = []
        for address, sender in sorted(self._senders.items()):
            error = sender.transport.link_error()
            if address in self._reported and self._reported[address] != error:
                if error is None:
                    log.warning("KV link to %s is up again", address)
                else:
                    log.warning("KV link to %s is down: %s", address, error)
            elif address not in self._reported and error is not None:
                log.warning("KV link to %s is down: %s", address, error)
            self._reported[address] = error
            states.append(LinkState(address, error, sender.meter.bytes_per_s, sender.meter.latency_s))
        return tuple(states)

    def close(self) -> None:
        for sender in self._senders.values():
            sender.transport.close()
        self._senders.clear()
