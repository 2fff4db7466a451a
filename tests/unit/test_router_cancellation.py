"""A client's cancel reaches the request even when it lands in the same event-loop turn as the
thing the request was waiting for. On Python 3.11 `asyncio.wait_for` returns the awaited result
then and drops the cancel; the router's waits (router/attempt.py `_next`, the prefill gate) must
not, or the request of a client that went away runs to its end (seen under the load test,
tests/integration/test_load.py: non-streaming HTTP clients that disconnected were generated to
their last token)."""

import asyncio
import time

import pytest

from router.attempt import _next
from router.prefill_gate import PrefillGate


class _Healthy:
    def healthy(self, worker_id):
        return True

    def incarnation(self, worker_id):
        return None


def test_a_cancel_in_the_turn_an_event_arrives_still_cancels_next():
    async def main():
        events = asyncio.Queue()
        waiting = asyncio.create_task(_next(events, time.monotonic() + 30, _Healthy(), {}))
        await asyncio.sleep(0)  # it waits in events.get()
        events.put_nowait("tokens")  # a worker event arrives ...
        waiting.cancel()  # ... in the same turn as the client's cancel
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return events.qsize()

    assert asyncio.run(main()) == 1  # not consumed by a request that is gone


def test_a_cancel_in_the_turn_the_gate_frees_room_still_cancels_acquire():
    async def main():
        gate = PrefillGate(max_tokens_per_worker=100)
        far = time.monotonic() + 30
        only_p0 = lambda full: None if "p0" in full else "p0"  # noqa: E731
        assert await gate.acquire(100, only_p0, far, TimeoutError) == "p0"  # p0 is full
        waiting = asyncio.create_task(gate.acquire(10, only_p0, far, TimeoutError))
        await asyncio.sleep(0)  # it waits for room
        gate.release("p0", 100)  # room ...
        waiting.cancel()  # ... in the same turn as the client's cancel
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return gate.outstanding("p0"), gate.num_waiting

    assert asyncio.run(main()) == (0, 0)  # no credit taken for a request that is gone
