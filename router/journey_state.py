"""What one request's journey is made of, shared by the journey (router/journey.py) and its
attempts (router/attempt.py): the validated request (`Journey`), the router's settings for it,
what the client has been sent so far (`Stream`, which outlives attempts), the errors that end
it, and the `Pool` protocol: what a journey needs of the router's workers (router/worker_pool.py
WorkerPool; a scripted fake in tests/unit/test_journey.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from proto import worker_messages as wm
from router.placement.block_index import BlockIndex
from router.placement.cost_model import LinkCost
from router.policy import WorkerLoad
from router.stop_strings import StopStringMatcher
from router.tokenizer import IncrementalDetokenizer
from router.ttft_stages import StageClock


class RouterError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class WorkerLost(RouterError):
    """A worker holding part of an attempt died (or its KV transfer did): worth another attempt."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


class Pool(Protocol):
    """Commands out, this request's events in, the workers' health and load."""

    def subscribe(self, request_id: str) -> asyncio.Queue: ...
    def unsubscribe(self, request_id: str) -> None: ...
    def involve(self, request_id: str, worker_id: str) -> None: ...
    def uninvolve(self, request_id: str, worker_id: str) -> None: ...
    def release(self, request_id: str) -> None: ...
    def incarnation(self, worker_id: str) -> str | None: ...
    def kv_address(self, worker_id: str) -> str | None: ...
    def kv_route(self, prefill_id: str, decode_id: str) -> str | None: ...
    def suspect(self, prefill_id: str, address: str) -> None: ...
    def reject(self, reason: str, detail: str) -> None: ...
    def healthy(self, worker_id: str) -> bool: ...
    def loads(self, role: str) -> list[WorkerLoad]: ...
    async def send(self, worker_id: str, message: object) -> None: ...
    def link_cost(self, prefill_id: str, address: str) -> LinkCost: ...
    def kv_bytes_per_token(self) -> int: ...
    blocks: BlockIndex  # which worker caches which pages


@dataclass(frozen=True)
class Journey:
    # The router's own id (router/request_ids.py): what every worker message, transfer and abort
    # carries. The client's id only comes back to the client in responses (and goes in logs).
    request_id: str
    client_id: str
    prompt: tuple[int, ...]
    sampling: wm.Sampling
    stop: tuple[str, ...]
    deadline: float  # time.monotonic() value


@dataclass(frozen=True)
class JourneySettings:
    mode: str  # "disaggregated" or "colocated"
    kv_timeout_s: float
    lease_s: float
    reserve_retry_s: float = 0.02
    max_prefill_queue_tokens: int = 8192  # prompt tokens sent to one prefill worker, not yet prefilled
    max_attempts: int = 3  # the first try plus retries after lost workers
    retry_wait_s: float = 10.0  # a retry waits this long for a healthy worker (a replacement) to appear


@dataclass
class Stream:
    """What the client has been sent so far; survives attempts."""

    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    stages: StageClock = field(default_factory=StageClock)  # its TTFT's stages (router/ttft_stages.py)
    generated: list[int] = field(default_factory=list)
    num_cached: int = 0
    spec_counts: dict[int, tuple[int, int]] = field(default_factory=dict)  # attempt -> (proposed, accepted)
    placement: str = ""  # where the last attempt computed the prompt (router/placement/): Usage.placement
    ended: bool = False  # the client got a finish reason
    done: bool = False  # ... and it was not "abort": the workers freed what they held themselves

    @property
    def ttft(self) -> float | None:
        """Arrival to the first token sent to the client (None before it)."""
        return self.stages.ttft_s
