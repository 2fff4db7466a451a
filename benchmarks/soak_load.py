"""The soak's clients (benchmarks/soak.py): planned streaming gRPC `Generate` calls, each ended
its own way (run to the end, gRPC deadline, request timeout_s, client cancel at a set moment),
each watched for a terminal state within its bound, all on one asyncio loop."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc

MAX_MESSAGE_BYTES = 64 << 20


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    at_s: float  # arrival, from the start of the load
    prompt: list[int]
    max_tokens: int
    reference: list[int]  # HF greedy's first max_tokens tokens for the prompt
    sampled: bool
    seed: int
    cancel_at_s: float | None  # the client cancels this long after sending
    cancel_after_tokens: int | None  # or once it holds this many tokens (fewer than max_tokens)
    grpc_deadline_s: float | None  # the call's gRPC deadline
    timeout_s: float | None  # GenerateRequest.timeout_s: the router's own deadline

    def bound_s(self, hang_s: float, grace_s: float) -> float:
        """How long after sending the stream must have reached a terminal state."""
        deadline = self.grpc_deadline_s or self.timeout_s
        return hang_s if deadline is None else deadline + grace_s

    def request(self) -> pb.GenerateRequest:
        sampling = pb.SamplingParams(max_tokens=self.max_tokens, ignore_eos=True)
        if self.sampled:
            sampling.temperature, sampling.top_p, sampling.seed = 0.8, 0.95, self.seed
        return pb.GenerateRequest(token_ids=pb.TokenIds(ids=self.prompt), sampling=sampling,
                                  timeout_s=self.timeout_s or 0.0)


@dataclass
class StreamResult:
    plan: PlannedRequest
    outcome: str = ""  # finished | cancelled | deadline | hung | failed
    status: str = ""  # the gRPC status code's name (failed, deadline), or what was wrong
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    sent: float = 0.0
    ended: float = 0.0

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def tpot_s(self) -> float | None:
        """(e2e - TTFT) / (n - 1), the field's definition (docs/design.md §6)."""
        n = len(self.tokens)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    def describe(self) -> str:
        p = self.plan
        return (f"request {p.index}: {len(p.prompt)}-token prompt, max_tokens {p.max_tokens}, "
                f"{'sampled' if p.sampled else 'greedy'}, {self.outcome} {self.status}, got {self.tokens}, "
                f"HF {p.reference}")


async def one_stream(stub, plan: PlannedRequest, start: float, hang_s: float, grace_s: float) -> StreamResult:
    await asyncio.sleep(max(0.0, plan.at_s - (time.monotonic() - start)))
    result = StreamResult(plan, sent=time.monotonic())
    call = stub.Generate(plan.request(), timeout=plan.grpc_deadline_s)
    finish = pb.FINISH_REASON_UNSPECIFIED
    cut_at_tokens = False

    async def read() -> None:
        nonlocal finish, cut_at_tokens
        async for resp in call:
            if resp.token_ids:
                now = time.monotonic()
                result.tokens.extend(resp.token_ids)
                result.token_times.extend([now] * len(resp.token_ids))
            if resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                finish = resp.finish_reason
            elif plan.cancel_after_tokens is not None and len(result.tokens) >= plan.cancel_after_tokens:
                cut_at_tokens = True  # the client gives up mid-decode
                call.cancel()
                return

    reader = asyncio.ensure_future(read())
    cancelling = plan.cancel_at_s is not None and plan.cancel_at_s < plan.bound_s(hang_s, grace_s)
    wait_s = plan.cancel_at_s if cancelling else plan.bound_s(hang_s, grace_s)
    done, _ = await asyncio.wait([reader], timeout=wait_s)
    if not done:
        call.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        result.outcome = "cancelled" if cancelling else "hung"
    else:
        try:
            reader.result()
            if cut_at_tokens:
                result.outcome = "cancelled"
            elif finish in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP):
                result.outcome = "finished"
            else:
                result.outcome, result.status = "failed", f"OK with finish {pb.FinishReason.Name(finish)}"
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            has_deadline = plan.grpc_deadline_s is not None or plan.timeout_s is not None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and has_deadline:
                result.outcome, result.status = "deadline", code.name
            else:
                result.outcome, result.status = "failed", code.name
    result.ended = time.monotonic()
    return result


async def run_all(address: str, plan: list[PlannedRequest], hang_s: float, grace_s: float,
                  max_concurrency: int) -> list[StreamResult]:
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        slots = asyncio.Semaphore(max_concurrency)  # an open loop, but never more than this in flight
        start = time.monotonic()

        async def bounded(p: PlannedRequest) -> StreamResult:
            await asyncio.sleep(max(0.0, p.at_s - (time.monotonic() - start)))
            async with slots:
                return await one_stream(stub, p, start, hang_s, grace_s)

        return list(await asyncio.gather(*(bounded(p) for p in plan)))


def run_load(address: str, plan: list[PlannedRequest], hang_s: float, grace_s: float,
             max_concurrency: int = 128) -> list[StreamResult]:
    """Sends every planned request at its moment; returns when every stream has ended (or was
    declared hung and cancelled)."""
    return asyncio.run(run_all(address, plan, hang_s, grace_s, max_concurrency))
