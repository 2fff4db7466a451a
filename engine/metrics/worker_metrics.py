"""One worker process's live Prometheus metrics, served at /metrics on the worker's own port.

Data flow: the engine hands every step's `StepStats` to `observe_step` (a step observer,
engine/metrics/step_stats.py); the KV sender or receiver hands every ended transfer's `TransferRecord`
to `observe_transfer` (engine/kv_transfer/sender.py, receiver.py); queue lengths, KV pages and the prefix
cache's counters are read from the engine when Prometheus scrapes, so they are current even
while the worker is idle. One registry per worker (no module-global default registry), every
series labelled with worker_id and role, so several workers in one process never collide.

Rates come from Prometheus (`rate()` of the token counters; MBU as
rate(decode_bytes) / rate(decode_step_seconds_sum) / peak); the `*_per_second`, MBU and MFU
gauges give the same over the last `window_s` seconds for a glance without a query.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import torch
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from engine.engine import LLMEngine
from engine.kv_transfer import TransferRecord, TransferState
from engine.metrics.peak import Peak
from engine.metrics.rejected import Counts, RejectedCollector
from engine.metrics.roofline import ModelCost
from engine.metrics.step_stats import StepStats
from engine.spec.speculator import SpecCounts

# Step and queue times from 0.1 ms (a GPU decode step) to 60 s (a long CPU prefill).
STEP_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0)
LABELS = ("worker_id", "role")


class _Window:
    """(time, amount, busy seconds) samples of the last `window_s` seconds: a recent rate per
    wall second and per busy second. Written by the step thread, read by scrapes: locked."""

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        self.window_s, self.clock = window_s, clock
        self.started = clock()
        self._samples: deque[tuple[float, float, float]] = deque()
        self._lock = threading.Lock()

    def add(self, amount: float, busy_s: float) -> None:
        with self._lock:
            self._samples.append((self.clock(), amount, busy_s))

    def _sums(self) -> tuple[float, float]:
        with self._lock:
            oldest = self.clock() - self.window_s
            while self._samples and self._samples[0][0] < oldest:
                self._samples.popleft()
            return sum(s[1] for s in self._samples), sum(s[2] for s in self._samples)

    def per_second(self) -> float:
        amount, _ = self._sums()
        return amount / max(1e-9, min(self.window_s, self.clock() - self.started))

    def per_busy_second(self) -> float:
        amount, busy = self._sums()
        return amount / busy if busy > 0 else 0.0


class _EngineState(Collector):
    """Read at scrape time: requests running / waiting, KV pages, prefix-cache counters."""

    def __init__(self, engine: LLMEngine, label_values: list[str]) -> None:
        self.engine, self.label_values = engine, label_values

    def collect(self) -> Iterator[Metric]:
        snap = self.engine.snapshot  # published by the serving thread: never read its live structures
        hit, queried = snap.prefix_hit_tokens, snap.prefix_queried_tokens
        for name, doc, value in (
            ("requests_running", "Sequences in the running batch", snap.num_running),
            ("requests_waiting", "Sequences waiting to be scheduled", snap.num_waiting),
            ("kv_pages_used", "KV pages referenced (running, held for a transfer, or reserved)",
             snap.referenced_pages),
            ("kv_pages_free", "KV pages allocatable (free or evictable prefix-cache pages)", snap.free_pages),
            ("kv_pages_total", "KV pages in the cache", snap.num_pages),
            ("kv_pages_cached", "KV pages holding a reusable prefix", snap.cached_pages),
            ("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens looked up",
             hit / queried if queried else 0.0),
        ):
            g = GaugeMetricFamily(f"pdserve_worker_{name}", doc, labels=LABELS)
            g.add_metric(self.label_values, value)
            yield g
        for name, doc, value in (("prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache", queried),
                                 ("prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache", hit)):
            c = CounterMetricFamily(f"pdserve_worker_{name}", doc, labels=LABELS)
            c.add_metric(self.label_values, value)
            yield c


class _SpecRatios(Collector):
    """Speculative decoding's ratios over the worker's life, by method, from the counts the step
    thread adds (locked): acceptance rate = accepted / proposed tokens; mean accepted length =
    tokens a verifying sequence-step emits = (accepted + verifying steps) / verifying steps
    (the target's own token included, so 1.0 means nothing accepted)."""

    def __init__(self, label_values: list[str]) -> None:
        self.label_values = label_values
        self.totals: dict[str, SpecCounts] = {}
        self.lock = threading.Lock()

    def add(self, method: str, counts: SpecCounts) -> None:
        with self.lock:
            total = self.totals.setdefault(method, SpecCounts())
            total.num_proposed += counts.num_proposed
            total.num_accepted += counts.num_accepted
            total.num_verified += counts.num_verified

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            totals = {m: (c.num_proposed, c.num_accepted, c.num_verified) for m, c in self.totals.items()}
        rate = GaugeMetricFamily("pdserve_worker_spec_acceptance_rate",
                                 "Accepted / proposed speculative tokens, by method", labels=LABELS + ("method",))
        length = GaugeMetricFamily("pdserve_worker_spec_mean_accepted_length",
                                   "Tokens emitted per verifying sequence-step (accepted + the target's own)",
                                   labels=LABELS + ("method",))
        for method, (proposed, accepted, verified) in sorted(totals.items()):
            rate.add_metric(self.label_values + [method], accepted / proposed if proposed else 0.0)
            length.add_metric(self.label_values + [method], (accepted + verified) / verified if verified else 0.0)
        yield rate
        yield length


class WorkerMetrics:
    def __init__(self, engine: LLMEngine, worker_id: str, role: str, peak: Peak, window_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, rejected: Callable[[], Counts] = dict) -> None:
        """`rejected`: the worker's dropped internal messages now (engine/metrics/rejected.py)."""
        dtype = next(engine.model.parameters()).dtype
        self.cost = ModelCost.of(engine.model_config, engine.weight_bytes(), torch.finfo(dtype).bits // 8)
        self.peak = peak
        self.registry = r = CollectorRegistry()
        values = [worker_id, role]
        r.register(_EngineState(engine, values))
        r.register(RejectedCollector(rejected, values))
        self._spec_ratios = _SpecRatios(values)
        r.register(self._spec_ratios)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()):
            m = Counter(f"pdserve_worker_{name}", doc, LABELS + extra, registry=r)
            return m if extra else m.labels(*values)

        def histogram(name: str, doc: str, extra: tuple[str, ...] = ()):
            m = Histogram(f"pdserve_worker_{name}", doc, LABELS + extra, buckets=STEP_BUCKETS, registry=r)
            return m if extra else m.labels(*values)

        def gauge(name: str, doc: str, read: Callable[[], float], extra: dict[str, str] | None = None) -> None:
            extra = extra or {}
            g = Gauge(f"pdserve_worker_{name}", doc, LABELS + tuple(extra), registry=r)
            g.labels(*values, *extra.values()).set_function(read)

        self._values = values
        self.prefill_tokens = counter("prefill_tokens", "Prompt (and recomputed) tokens computed")
        self.decode_tokens = counter("decode_tokens", "Tokens computed by decode steps")
        self.prefill_step = histogram("prefill_step_seconds", "Time of steps with prefill work (mixed steps too)")
        self.decode_step = histogram("decode_step_seconds", "Time of steps with decode work (mixed steps too)")
        self.decode_bytes = counter("decode_bytes", "Bytes decode steps must read (weights + KV context)")
        self.prefill_flops = counter("prefill_flops", "FLOPs of prefill work (projections, attention, lm_head)")
        self.queue_time = histogram("queue_time_seconds", "Arrival at the engine to first scheduled")
        self._spec_proposed = counter("spec_proposed_tokens", "Speculative tokens proposed and verified, by method",
                                      ("method",))
        self._spec_accepted = counter("spec_accepted_tokens", "Speculative tokens the target accepted, by method",
                                      ("method",))
        self._spec_verified = counter("spec_verify_steps",
                                      "Sequence-steps that verified proposed tokens, by method", ("method",))
        self._transfer_bytes = counter("kv_transfer_bytes", "KV page bytes moved", ("direction",))
        self._transfer_time = histogram("kv_transfer_seconds", "First page frame to the transfer's end, by side",
                                        ("side",))
        self._transfer_failures = counter("kv_transfer_failures",
                                          "Transfers not ended DONE, by side and reason (corrupt, failed, expired, aborted)",
                                          ("side", "reason"))

        self._prefill_window, self._decode_window = _Window(window_s, clock), _Window(window_s, clock)
        self._flops_window, self._bytes_window = _Window(window_s, clock), _Window(window_s, clock)
        gauge("prefill_tokens_per_second", f"Prefill tokens per second over the last {window_s:g} s",
              self._prefill_window.per_second)
        gauge("decode_tokens_per_second", f"Decode tokens per second over the last {window_s:g} s",
              self._decode_window.per_second)
        gauge("decode_mbu", f"Decode memory-bandwidth utilisation over the last {window_s:g} s of decode steps",
              lambda: self._bytes_window.per_busy_second() / peak.memory_bytes_per_s)
        gauge("prefill_mfu", f"Prefill FLOP utilisation over the last {window_s:g} s of prefill steps",
              lambda: self._flops_window.per_busy_second() / peak.flops_per_s)
        gauge("peak_memory_bytes_per_second", "Peak MBU is measured against", lambda: peak.memory_bytes_per_s,
              {"source": peak.source})
        gauge("peak_flops_per_second", "Peak MFU is measured against", lambda: peak.flops_per_s,
              {"source": peak.source})
        self._server = None

    # -- observers (called on the worker's step thread) -------------------------------------------
    def observe_step(self, stats: StepStats) -> None:
        work, t = stats.work, stats.step_time_s
        for method, counts in stats.spec.by_method.items():
            self._spec_proposed.labels(*self._values, method).inc(counts.num_proposed)
            self._spec_accepted.labels(*self._values, method).inc(counts.num_accepted)
            self._spec_verified.labels(*self._values, method).inc(counts.num_verified)
            self._spec_ratios.add(method, counts)
        for queue_s in stats.queue_times_s:
            self.queue_time.observe(queue_s)
        if work.num_prefill_tokens:
            flops = self.cost.prefill_flops(work)
            self.prefill_tokens.inc(work.num_prefill_tokens)
            self.prefill_step.observe(t)
            self.prefill_flops.inc(flops)
            self._prefill_window.add(work.num_prefill_tokens, t)
            self._flops_window.add(flops, t)
        if work.num_decode_tokens:
            num_bytes = self.cost.decode_bytes(work)
            self.decode_tokens.inc(work.num_decode_tokens)
            self.decode_step.observe(t)
            self.decode_bytes.inc(num_bytes)
            self._decode_window.add(work.num_decode_tokens, t)
            self._bytes_window.add(num_bytes, t)

    def observe_transfer(self, record: TransferRecord) -> None:
        direction = "sent" if record.side == "send" else "received"
        self._transfer_bytes.labels(*self._values, direction).inc(record.num_bytes)
        self._transfer_time.labels(*self._values, record.side).observe(record.duration_s)
        if record.state is not TransferState.DONE:
            self._transfer_failures.labels(*self._values, record.side, record.failure_reason).inc()

    # -- exposition ---------------------------------------------------------------------------------
    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, host: str, port: int) -> None:
        """Serves /metrics on host:port from a daemon thread until `close`."""
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
