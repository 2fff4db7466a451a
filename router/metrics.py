"""Request-level serving metrics as the router sees them, in Prometheus form.

`Router.run` reports each request's timeline here: TTFT at its first token, ITL between
streamed responses, TPOT = (E2E - TTFT) / (tokens - 1) and E2E at the end, its finish reason
or error status. The registry belongs to one Router (no module-global state); the HTTP front
door serves it at /metrics.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets from 1 ms to 60 s: CPU runs of the tiny model and GPU runs of real ones.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Arrival to first token", buckets=BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_time_per_output_token_seconds", "(E2E - TTFT) / (tokens - 1), per request",
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
        self.in_flight = Gauge("pdserve_requests_in_flight", "Requests admitted and not finished", registry=r)

    def request_finished(self, finish_reason: str, ttft_s: float | None, e2e_s: float, num_tokens: int,
                         prompt_tokens: int, cached_prompt_tokens: int) -> None:
        self.finished.labels(finish_reason).inc()
        self.e2e.observe(e2e_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            if num_tokens > 1:
                self.tpot.observe((e2e_s - ttft_s) / (num_tokens - 1))
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(num_tokens)
        self.cached_prompt_tokens.inc(cached_prompt_tokens)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
