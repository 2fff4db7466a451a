"""The router's prefill credit (router/prefill_gate.py): FIFO turns, per-worker token budgets,
an idle worker taking any prompt, deadlines, and credit returned exactly once."""

import asyncio
import time

import pytest

from router.prefill_gate import PrefillGate


def choose_from(workers):
    """A policy stand-in: the first listed worker that is not full."""
    return lambda full: next((w for w in workers if w not in full), None)


def run(coro):
    return asyncio.run(coro)


def test_budget_per_worker_then_the_next_worker():
    async def main():
        gate = PrefillGate(max_tokens_per_worker=100)
        far = time.monotonic() + 5
        a = await gate.acquire(60, choose_from(["p0", "p1"]), far, TimeoutError)
        b = await gate.acquire(40, choose_from(["p0", "p1"]), far, TimeoutError)  # p0 reaches exactly 100
        c = await gate.acquire(10, choose_from(["p0", "p1"]), far, TimeoutError)  # p0 is full now
        return a, b, c, gate.outstanding("p0"), gate.outstanding("p1")

    assert run(main()) == ("p0", "p0", "p1", 100, 10)


def test_an_idle_worker_takes_a_prompt_longer_than_the_budget():
    async def main():
        gate = PrefillGate(max_tokens_per_worker=100)
        return await gate.acquire(5000, choose_from(["p0"]), time.monotonic() + 5, TimeoutError)

    assert run(main()) == "p0"


def test_waiters_are_served_first_come_first_served_on_release():
    async def main():
        gate = PrefillGate(max_tokens_per_worker=100)
        far = time.monotonic() + 5
        await gate.acquire(100, choose_from(["p0"]), far, TimeoutError)
        order = []

        async def wait(name, tokens):
            await gate.acquire(tokens, choose_from(["p0"]), far, TimeoutError)
            order.append(name)

        # A big prompt first, then a small one that would fit sooner: the small one waits its turn.
        first = asyncio.create_task(wait("big", 100))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(wait("small", 10))
        await asyncio.sleep(0.1)
        assert order == [] and gate.num_waiting == 2
        gate.release("p0", 100)
        await asyncio.wait_for(first, 1)
        await asyncio.sleep(0.1)
        assert order == ["big"]  # p0 holds 100 again: "small" still waits
        gate.release("p0", 100)
        await asyncio.wait_for(second, 1)
        return order, gate.outstanding("p0"), gate.num_waiting

    assert run(main()) == (["big", "small"], 10, 0)


def test_a_waiter_past_its_deadline_raises_and_leaves_the_queue():
    class Late(Exception):
        pass

    async def main():
        gate = PrefillGate(max_tokens_per_worker=10)
        await gate.acquire(10, choose_from(["p0"]), time.monotonic() + 5, TimeoutError)
        with pytest.raises(Late):
            await gate.acquire(5, choose_from(["p0"]), time.monotonic() + 0.1, Late)
        return gate.num_waiting

    assert run(main()) == 0


def test_credit_is_returned_exactly_once():
    gate = PrefillGate(max_tokens_per_worker=10)
    run(gate.acquire(7, choose_from(["p0"]), time.monotonic() + 1, TimeoutError))
    gate.release("p0", 7)
    assert gate.outstanding("p0") == 0
    with pytest.raises(RuntimeError, match="was not holding"):
        gate.release("p0", 7)


def test_bad_budget_is_refused():
    with pytest.raises(ValueError, match=">= 1"):
        PrefillGate(0)
