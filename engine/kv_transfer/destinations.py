"""Where a prefill worker may push KV: the KV addresses of its cluster's decode workers.

A `Prefill` command names its destination (KVDestination.address, from the decode worker's
`Reserved` reply relayed by the router). Commands and events travel on sockets a peer can
write to, so the address is checked against this set before any KV is computed for it or any
connection is opened (prefill_worker/worker.py): a forged or buggy command fails that request
alone, instead of making the worker push KV to any host:port.

The set comes from the process that starts the workers, never from the command socket: the
cluster learns each decode worker's KV address from the worker itself when it is ready and
gives every prefill worker the whole set before the router may route to it, again whenever a
decode worker joins, leaves or is replaced (cluster/kv_destinations.py; tests/local_cluster.py
in-process). Read on the serving thread, replaced from another (a Ray actor call): each update
swaps one immutable set, so a reader sees the old set or the new one, never a mix.
"""

from __future__ import annotations

from collections.abc import Iterable


class KVDestinations:
    def __init__(self, addresses: Iterable[str] = ()) -> None:
        """`addresses`: host:port of each decode worker's KV receiver (`dist:<rank>` for the
        torch_dist transport); empty = no destination is accepted yet."""
        self._addresses = frozenset(addresses)

    @property
    def addresses(self) -> frozenset[str]:
        return self._addresses

    def replace(self, addresses: Iterable[str]) -> None:
        """The whole set, as it is now (a decode worker that left is no longer in it)."""
        self._addresses = frozenset(addresses)

    def allows(self, address: str) -> bool:
        return address in self._addresses

    def refusal(self, address: str) -> str:
        """Why `address` is refused, for the request's error and the log (bounded: the address
        is a peer's string)."""
        shown = address if len(address) <= 80 else address[:80] + "..."
        return (f"KV destination {shown!r} is not a known decode endpoint of this cluster "
                f"({len(self._addresses)} known)")
