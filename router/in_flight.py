"""The router's books of admitted requests: how many are in flight, their prompt tokens, and
the prompt tokens not computed yet (no first token), with the admission bounds on the first two.
One object owns them (router/server.py asks it before admitting and holds one `Admitted` per
request); a request's share is returned exactly once, however it ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from prometheus_client import Gauge

from router.journey_state import RouterError


@dataclass
class InFlight:
    max_requests: int  # router.max_queued_requests
    max_prompt_tokens: int  # router.max_queued_prompt_tokens
    gauge: Gauge | None = None  # pdserve_requests_in_flight
    requests: int = 0
    prompt_tokens: int = 0
    unprefilled_tokens: int = 0  # of requests with no first token yet (SLO admission's queue)

    def check(self, prompt_tokens: int) -> None:
        """RESOURCE_EXHAUSTED when admitting a prompt of `prompt_tokens` would pass a bound."""
        if self.requests >= self.max_requests:
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.requests} requests in flight: "
                              f"over the bound of {self.max_requests}; retry in a moment")
        if self.prompt_tokens + prompt_tokens > self.max_prompt_tokens:
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{self.prompt_tokens} prompt tokens in flight: this prompt's {prompt_tokens} would "
                              f"pass router.max_queued_prompt_tokens ({self.max_prompt_tokens}); retry in a moment")

    def admit(self, prompt_tokens: int) -> Admitted:
        """Counts a request in; the caller must `end()` what it is given."""
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.unprefilled_tokens += prompt_tokens
        if self.gauge is not None:
            self.gauge.inc()
        return Admitted(self, prompt_tokens)


@dataclass
class Admitted:
    """One admitted request's share of the books."""

    books: InFlight
    prompt_tokens: int
    prefilled: bool = False
    ended: bool = field(default=False)

    def first_token(self) -> None:
        if not self.prefilled and not self.ended:
            self.prefilled = True
            self.books.unprefilled_tokens -= self.prompt_tokens

    def end(self) -> None:
        if self.ended:
            return
        self.first_token()  # its prompt is no longer waiting either way
        self.ended = True
        self.books.requests -= 1
        self.books.prompt_tokens -= self.prompt_tokens
        if self.books.gauge is not None:
            self.books.gauge.dec()
