"""Randomised scheduler + page manager runs (seeded): the invariants hold after every step.

Random page sizes and budgets, shared prefixes, prefix caching on and off, random aborts of
waiting and running requests, preemption under tight page budgets. After every schedule and
every finish_step: reference counts equal the page tables' contents, free + referenced pages
add up, `running` is in arrival order, and the scheduler never idles while work is pending.
"""

from __future__ import annotations

import random

import pytest

from engine.page_manager import PageManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, Sequence


def check_invariants(pm: PageManager, sched: Scheduler) -> None:
    expected = [0] * pm.num_pages
    for seq in list(sched.running) + list(sched.waiting):
        for page in seq.page_table:
            expected[page] += 1
    assert pm.ref_counts == expected
    assert pm.num_free_pages + sum(1 for refs in expected if refs) == pm.num_pages
    arrivals = [s.arrival_index for s in sched.running]
    assert arrivals == sorted(arrivals)


@pytest.mark.parametrize("trial", range(40))
def test_random_workloads_keep_page_invariants(trial):
    rng = random.Random(trial)
    page_size = rng.choice([1, 2, 4, 8])
    num_pages = rng.randrange(4, 20)
    max_num_seqs = rng.randrange(1, 5)
    pm = PageManager(num_pages, page_size, enable_prefix_caching=rng.random() < 0.7)
    sched = Scheduler(pm, max_num_seqs, rng.randrange(max_num_seqs, 40))
    capacity = num_pages * page_size
    shared = [rng.randrange(50) for _ in range(3 * page_size)]
    seqs: list[Sequence] = []
    idle_steps = 0
    for _ in range(3000):
        if len(seqs) < 25 and rng.random() < 0.3:
            prompt_len = rng.randrange(1, capacity)
            prompt = (shared[: rng.randrange(len(shared) + 1)] + [rng.randrange(50) for _ in range(prompt_len)])
            prompt = prompt[:prompt_len]
            # What LLMEngine.add_request admits: prompt + max_tokens - 1 <= capacity.
            params = SamplingParams(max_tokens=rng.randrange(1, capacity - len(prompt) + 2))
            seqs.append(Sequence(f"r{len(seqs)}", prompt, params, len(seqs), 10**6))
            sched.add(seqs[-1])
        if seqs and rng.random() < 0.05:
            victim = rng.choice(seqs)
            sched.finish(victim, FinishReason.ABORT)  # a no-op when already finished
        out = sched.schedule()
        check_invariants(pm, sched)
        sampled = [s.seq for s in out.scheduled if s.samples]
        sched.finish_step(out)
        for seq in sampled:
            seq.token_ids.append(rng.randrange(50))
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                sched.finish(seq, FinishReason.LENGTH)
        check_invariants(pm, sched)
        idle_steps = idle_steps + 1 if sched.has_unfinished() and not out.scheduled else 0
        assert idle_steps < 3, "the scheduler idled while requests were pending"
        if len(seqs) >= 25 and not sched.has_unfinished():
            break
    assert not sched.has_unfinished(), "work left after 3000 steps"
    assert pm.num_referenced_pages == 0
    assert all(s.is_finished for s in seqs)
