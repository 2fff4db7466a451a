"""One request's journey through the cluster, as seen by the router (docs/design.md §2).

`run_journey` drives the worker messages for one validated request and yields response
messages as text becomes available. Disaggregated: wait for a prefill worker with room
(router/prefill_gate.py: the queue waits here, holding nothing), reserve pages on a decode
worker (retrying while the pool is full: backpressure), then prefill, stream the first token as soon
as it arrives, decode joins when the KV lands, stream the rest. Colocated: one Generate. Whatever ends an
attempt (finish, stop string, error, cancel, deadline, a lost worker), its `finally` sends
Abort to every worker involved that may still hold something, so pages are freed on every side.

A worker that dies under a request (no heartbeat, or a KV transfer that failed because its
sender died) does not fail the request: a new attempt re-sends the prompt plus every token the
client already has, as a fresh prompt, to healthy workers (another decode reservation, another
prefill), and the stream goes on where it stopped. Greedy decoding continues with exactly the
tokens the lost worker would have produced; sampled decoding continues from the same text with
fresh draws. Attempt k > 0 runs on the workers under the id `<internal id>.retry<k>`, so events
of a lost attempt are never mistaken for the new one's. After `max_attempts` the client gets
UNAVAILABLE naming what was lost.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from proto import pdserve_pb2 as pb
from router.attempt import Attempt, respond
from router.journey_state import Journey, JourneySettings, Pool, RouterError, Stream, WorkerLost
from router.placement.decide import PlacementSettings
from router.placement.placer import Placer
from router.policy import LeastLoadedPolicy
from router.prefill_gate import PrefillGate
from router.stop_strings import StopStringMatcher
from router.tokenizer import IncrementalDetokenizer, RouterTokenizer

log = logging.getLogger(__name__)


async def run_journey(
    j: Journey, pool: Pool, policy: LeastLoadedPolicy, tokenizer: RouterTokenizer, settings: JourneySettings,
    on_dispatch: Callable[[str], None] | None = None, gate: PrefillGate | None = None,
    placer: Placer | None = None,
) -> AsyncIterator[pb.GenerateResponse]:
    """`on_dispatch(worker_id)` is called once, when the prompt is first sent to the worker that
    computes it (after any wait for prefill room and decode pages): the end of the request's
    router queue time. `gate` and `placer` are shared by every request of one router
    (disaggregated mode); without them, this request gets its own (tests)."""
    gate = gate or PrefillGate(settings.max_prefill_queue_tokens)
    placer = placer or Placer(PlacementSettings(), gate)
    stream = Stream(IncrementalDetokenizer(tokenizer), StopStringMatcher(list(j.stop)))
    dispatched = [] if on_dispatch is None else [on_dispatch]
    lost: list[str] = []
    for attempt in range(settings.max_attempts):
        if attempt > 0 and (reason := _ended(j, stream, tokenizer)) is not None:
            yield respond(j, stream, [], reason)  # the lost worker had nothing left to send
            return
        try:
            tries = Attempt(j, attempt, stream, pool, policy, settings, dispatched, gate, placer).run()
            async with contextlib.aclosing(tries):
                async for response in tries:
                    yield response
            return
        except WorkerLost as exc:
            lost.append(str(exc))
            log.warning("request %s (client id %s): attempt %d lost (%s); %s", j.request_id, j.client_id,
                        attempt + 1, exc, "retrying" if attempt + 1 < settings.max_attempts else "giving up")
        except RouterError as exc:
            if not lost:
                raise
            raise RouterError(exc.code, f"{exc} (retrying after: {'; '.join(lost)})") from None
    raise RouterError(grpc.StatusCode.UNAVAILABLE, f"gave up after {settings.max_attempts} attempts: {'; '.join(lost)}")


def _ended(j: Journey, stream: Stream, tokenizer: RouterTokenizer) -> str | None:
    """The finish reason the lost worker would have sent, when the client already has the
    request's last token: max_tokens reached, or a stop / end-of-sequence token."""
    if len(stream.generated) >= j.sampling.max_tokens:
        return "length"
    last = stream.generated[-1] if stream.generated else None
    if last is not None and (last in j.sampling.stop_token_ids
                             or (not j.sampling.ignore_eos and last in tokenizer.eos_token_ids)):
        return "stop"
    return None
