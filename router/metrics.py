"""Request-level serving metrics as the router sees them, in Prometheus form.

`Router.run` reports each request's timeline here: queue time at dispatch, TTFT at its first
token, ITL between streamed responses, TPOT = (E2E - TTFT) / (tokens - 1) and E2E at the end,
its finish reason or error status, and whether it met the SLO targets (live goodput,
router/slo.py). The registry belongs to one Router (no module-global state); the HTTP front
door serves it at /metrics. Workers serve their own (engine/metrics/worker_metrics.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from proto.usage_stages import request_stages, usage_stages
from router.slo import SloTargets, SloWindow, tpot_of

# Latency buckets from 1 ms to 60 s: CPU runs of the tiny model and GPU runs of real ones.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    def __init__(self, slo: SloTargets | None = None, slo_window_s: float = 60.0) -> None:
        self.slo = slo or SloTargets()
        self.slo_window = SloWindow(slo_window_s)
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Arrival to first token", buckets=BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_time_per_output_token_seconds", "(E2E - TTFT) / (tokens - 1), per request",
                              buckets=BUCKETS, registry=r)
        # Queued and prefill sum to the TTFT; transfer and decode_wait are the remote placement's
        # hand-off after the first token (router/ttft_stages.py says why the TTFT has none).
        self.stages = Histogram("pdserve_request_stage_seconds", "A request's TTFT stages (queued, prefill) and "
                                "its KV hand-off (transfer, decode_wait), on the router's clock", ["stage"],
                                buckets=BUCKETS, registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "Gap between streamed responses",
                             buckets=BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "Arrival to last token", buckets=BUCKETS, registry=r)
        self.finished = Counter("pdserve_requests_finished", "Requests by finish reason", ["finish_reason"], registry=r)
        self.errors = Counter("pdserve_request_errors", "Requests ended by an error, by gRPC status", ["status"],
                              registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Tokens generated for finished requests",
                                         registry=r)
        self.cached_prompt_tokens = Counter("pdserve_cached_prompt_tokens", "Prompt tokens served from a prefix cache",
                                            registry=r)
        self.spec_proposed_tokens = Counter("pdserve_spec_proposed_tokens",
                                            "Speculative tokens proposed for finished requests", registry=r)
        self.spec_accepted_tokens = Counter("pdserve_spec_accepted_tokens",
                                            "Speculative tokens accepted for finished requests", registry=r)
        self.rejected_messages = Counter("pdserve_rejected_messages", "Internal messages dropped, by socket and reason",
                                         ["socket", "reason"], registry=r)
        self.slo_refused = Counter("pdserve_slo_refused", "Requests refused at admission: predicted TTFT past "
                                   "router.slo_admission_factor x slo_ttft_ms (router/slo_admission.py)", registry=r)
        self.in_flight = Gauge("pdserve_requests_in_flight", "Requests admitted and not finished", registry=r)
        self.placements = Counter("pdserve_placement_decisions", "Where each attempt's prompt was computed "
                                  "(remote, local, suffix) and why (router/placement/decide.py)",
                                  ["placement", "reason"], registry=r)
        self.role_flips = Counter("pdserve_role_flips", "Workers flipped between prefill and decode, by the role "
                                  "flipped to and who decided (router/role_switch/)", ["role", "by"], registry=r)
        self.queue_time = Histogram("pdserve_router_queue_time_seconds",
                                    "Admission to dispatch (prefill or colocated worker chosen and sent)",
                                    buckets=BUCKETS, registry=r)
        self.goodput = Counter("pdserve_goodput_requests", "Finished requests meeting every configured SLO target",
                               registry=r)
        self.slo_attainment = Gauge("pdserve_slo_attainment_ratio",
                                    f"Share of requests finished in the last {slo_window_s:g} s meeting every "
                                    f"SLO target (NaN: none finished)", registry=r)
        self.slo_attainment.set_function(self.slo_window.attainment)
        for name, target in (("ttft", self.slo.ttft_s), ("tpot", self.slo.tpot_s)):  # so dashboards can draw the line
            if target is not None:
                Gauge(f"pdserve_slo_{name}_target_seconds", f"Configured {name.upper()} target",
                      registry=r).set(target)

    def watch_kv_links(self, links: Callable[[], Iterable[tuple[str, str, bool]]]) -> None:
        """`pdserve_kv_link_up{src,dst}`, read from `links()` (prefill id, decode id, up) at each
        scrape: 1 while the pair's own KV link is up, 0 while it is down (its KV may still move
        over a fallback, `pdserve status` says)."""
        self.registry.register(_LinkCollector(links))

    def request_finished(self, finish_reason: str, ttft_s: float | None, e2e_s: float, num_tokens: int,
                         prompt_tokens: int, cached_prompt_tokens: int, spec_proposed_tokens: int = 0,
                         spec_accepted_tokens: int = 0) -> None:
        self.finished.labels(finish_reason).inc()
        self.e2e.observe(e2e_s)
        tpot_s = tpot_of(ttft_s, e2e_s, num_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        if finish_reason != "abort":  # an aborted request is not served output
            met = self.slo.met(ttft_s, tpot_s)
            self.slo_window.record(met, ttft_s, tpot_s)
            if met:
                self.goodput.inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(num_tokens)
        self.cached_prompt_tokens.inc(cached_prompt_tokens)
        self.spec_proposed_tokens.inc(spec_proposed_tokens)
        self.spec_accepted_tokens.inc(spec_accepted_tokens)

    def request_stages(self, usage) -> None:
        """The final Usage's stages (a proto Usage: its ttft_breakdown and kv_handoff)."""
        for stage, seconds in request_stages(usage_stages(usage)).items():
            self.stages.labels(stage).observe(seconds)

    def request_failed(self, status: str, admitted: bool) -> None:
        """An error status; an admitted request that failed (not a client cancel) also counts
        as a miss in the attainment window."""
        self.errors.labels(status).inc()
        if admitted and status != "CANCELLED":
            self.slo_window.record(False)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _LinkCollector(Collector):
    def __init__(self, links: Callable[[], Iterable[tuple[str, str, bool]]]) -> None:
        self._links = links

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("pdserve_kv_link_up", "Prefill->decode KV link up (1) or down (0)",
                                   labels=["src", "dst"])
        for src, dst, up in self._links():
            family.add_metric([src, dst], 1.0 if up else 0.0)
        yield family
