"""The role-switching controller's decisions on scripted requests (router/role_switch/controller.py):
which way it flips, which worker, that it waits for samples and a sustained condition, and that
its hysteresis (bands, cooldown, flip cap) keeps any load, steady or swinging, to at most 2
flips in 5 minutes."""

from __future__ import annotations

import pytest

from configs.role_switching import RoleSwitchingConfig
from router.role_switch.controller import Candidate, RoleController

TTFT, TPOT = 2.0, 0.1  # SLO targets, seconds


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def controller(**config) -> tuple[RoleController, Clock]:
    clock = Clock()
    settings = {"sustain_s": 4.0, "min_samples": 4, "window_s": 20.0, **config}
    return RoleController(RoleSwitchingConfig(mode="auto", **settings), TTFT, TPOT, clock), clock


def workers(prefill: int = 1, decode: int = 2) -> list[Candidate]:
    return ([Candidate(f"prefill-{i}", "prefill", True, 0, 100 * (i + 1)) for i in range(prefill)]
            + [Candidate(f"decode-{i}", "decode", True, 5 - i, 0) for i in range(decode)])


def feed(c: RoleController, clock: Clock, ttft_s: float, tpot_s: float, seconds: float, mix=None,
         every_s: float = 1.0) -> list:
    """Two requests finish each second with these latencies; the controller looks every second.
    Returns the flips it decided (each made at once, as the router does)."""
    flips = []
    end = clock.t + seconds
    while clock.t < end:
        clock.t += every_s
        c.observe(ttft_s, tpot_s)
        c.observe(ttft_s, tpot_s)
        choice = c.decide(mix if mix is not None else workers())
        if choice is not None:
            flips.append(choice)
            c.flipped()
    return flips


def test_prompts_waiting_while_decode_idles_flip_the_least_busy_decode_worker():
    c, clock = controller()
    flips = feed(c, clock, ttft_s=3.0, tpot_s=0.02, seconds=10)
    assert [(f.worker_id, f.role) for f in flips] == [("decode-1", "prefill")]  # decode-1 runs fewer
    assert "TTFT p90 3.000 s (150% of target)" in flips[0].reason and "prefill short of workers" in flips[0].reason


def test_slow_decodes_while_prefill_idles_flip_the_least_queued_prefill_worker():
    c, clock = controller()
    flips = feed(c, clock, ttft_s=0.2, tpot_s=0.3, seconds=10, mix=workers(prefill=2, decode=1))
    assert [(f.worker_id, f.role) for f in flips] == [("prefill-0", "decode")]


@pytest.mark.parametrize(("ttft_s", "tpot_s"), [
    (3.0, 0.3),  # both under pressure: more workers are needed (the autoscaler's), not another mix
    (1.2, 0.06),  # between the bands on both sides: nothing to gain
    (0.2, 0.02),  # both idle
])
def test_no_flip_without_one_side_short_and_the_other_spare(ttft_s, tpot_s):
    c, clock = controller()
    assert feed(c, clock, ttft_s, tpot_s, seconds=60) == []


def test_it_waits_for_samples_and_for_the_condition_to_last():
    c, clock = controller(sustain_s=10.0, min_samples=30)
    assert feed(c, clock, 3.0, 0.02, seconds=14) == []  # 28 samples: too few to judge
    flips = feed(c, clock, 3.0, 0.02, seconds=14)
    assert len(flips) == 1  # once 30 are in and the pressure has lasted 10 s
    c2, clock2 = controller(sustain_s=10.0, window_s=4.0)
    assert feed(c2, clock2, 3.0, 0.02, seconds=6) == []
    assert feed(c2, clock2, 0.2, 0.02, seconds=5) == []  # the pressure left the window: its timer starts again
    assert feed(c2, clock2, 3.0, 0.02, seconds=8) == []
    assert len(feed(c2, clock2, 3.0, 0.02, seconds=4)) == 1


def test_a_flip_never_leaves_a_role_without_a_worker():
    c, clock = controller()
    assert feed(c, clock, 3.0, 0.02, seconds=30, mix=workers(prefill=1, decode=1)) == []  # the only decode
    c, clock = controller(min_workers_per_role=0)
    assert len(feed(c, clock, 0.2, 0.3, seconds=30, mix=workers(prefill=1, decode=1))) == 1  # prefill may empty
    c, clock = controller()  # min_workers_per_role 1: the last prefill worker stays
    assert feed(c, clock, 0.2, 0.3, seconds=30, mix=workers(prefill=1, decode=1)) == []
    sick = [Candidate("decode-0", "decode", True, 0, 0), Candidate("decode-1", "decode", False, 0, 0),
            Candidate("prefill-0", "prefill", True, 0, 0)]
    c, clock = controller()
    assert feed(c, clock, 3.0, 0.02, seconds=30, mix=sick) == []  # an unhealthy one does not count


@pytest.mark.parametrize("period_s", [6.0, 20.0, 45.0, 90.0])
def test_any_load_makes_at_most_two_flips_in_five_minutes(period_s):
    """A load that swings between prefill-heavy and decode-heavy every `period_s`, for 30 minutes."""
    c, clock = controller(sustain_s=2.0, cooldown_s=10.0)
    times = []
    start = clock.t
    while clock.t < start + 1800:
        heavy_prompts = int((clock.t - start) // period_s) % 2 == 0
        flips = feed(c, clock, 3.0 if heavy_prompts else 0.2, 0.02 if heavy_prompts else 0.3, seconds=1)
        times += [clock.t] * len(flips)
    assert times, "a swinging load flips at all"
    assert max(sum(1 for u in times if t <= u < t + 300) for t in times) <= 2


def test_steady_load_after_a_flip_that_fixed_it_flips_no_more():
    c, clock = controller()
    assert len(feed(c, clock, 3.0, 0.02, seconds=10)) == 1
    # The new mix serves within the bands: it stays, however long.
    assert feed(c, clock, 1.0, 0.06, seconds=600) == []


def test_bands_must_leave_a_gap():
    with pytest.raises(ValueError, match="must be under role_switching.high"):
        RoleSwitchingConfig(low=0.8, high=0.8)
