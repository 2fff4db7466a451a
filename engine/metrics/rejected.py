"""Internal messages a worker dropped, by socket and reason: `pdserve_rejected_messages_total`.

Data flow: the worker's command loop (cluster/serving_loop.py, socket "commands") and its KV
receiver (engine/kv_transfer/zmq_transport.py, socket "kv") call `RejectedMessages.count` for
every message they drop: "unauthenticated" (not signed under the cluster's secret, altered, or
meant for another socket), "replayed", "stale" (proto/frame_auth.py), "malformed" (failed its
schema), "refused" (a message the role does not take), "error". The worker's host adds the
role's own refusals (a prefill worker's unknown KV destination) and serves the sum at /metrics
through `RejectedCollector`, under the router's metric name and socket/reason labels
(router/metrics.py) plus worker_id and role, so one query sums them over the whole cluster.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping

from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

Counts = Mapping[tuple[str, str], int]  # (socket, reason) -> messages dropped


class RejectedMessages:
    """Counts from the threads that drop messages, read by scrapes and status calls: locked."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def count(self, socket: str, reason: str) -> None:
        with self._lock:
            self._counts[socket, reason] = self._counts.get((socket, reason), 0) + 1

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)


class RejectedCollector(Collector):
    """Read at scrape time from `read` (the host's counts plus the role's refusals)."""

    def __init__(self, read: Callable[[], Counts], label_values: list[str]) -> None:
        self.read, self.label_values = read, label_values

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("pdserve_rejected_messages", "Internal messages dropped, by socket and reason",
                                     labels=("worker_id", "role", "socket", "reason"))
        for (socket, reason), value in sorted(self.read().items()):
            family.add_metric([*self.label_values, socket, reason], value)
        yield family
