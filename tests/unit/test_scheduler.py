"""Scheduler + PageManager driven directly with Sequence objects (no model)."""

from __future__ import annotations

import pytest

from engine.page_manager import PageManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import FinishReason, Sequence, SequenceStatus
from proto.block_hash import hash_full_pages

FAKE_TOKEN = 7


class Harness:
    def __init__(self, num_pages=64, page_size=4, max_num_seqs=8, max_num_batched_tokens=64, prefix=True):
        self.pm = PageManager(num_pages, page_size, enable_prefix_caching=prefix)
        self.sched = Scheduler(self.pm, max_num_seqs, max_num_batched_tokens)
        self.n = 0

    def add(self, prompt, request_id=None) -> Sequence:
        seq = Sequence(
            request_id=request_id or f"r{self.n}", prompt_token_ids=list(prompt), params=SamplingParams(),
            arrival_index=self.n, max_total_tokens=10_000,
        )
        self.n += 1
        self.sched.add(seq)
        return seq

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        check_page_tables(self.pm, self.sched)
        # `samples` is derived from num_computed_tokens, which finish_step advances: read it
        # first, as the engine's ModelRunner does.
        sampling = [s.seq for s in out.scheduled if s.samples]
        self.sched.finish_step(out)
        for seq in sampling:
            seq.token_ids.append(FAKE_TOKEN)
        check_consistency(self.pm, self.sched)
        return out

    def finish(self, seq, reason=FinishReason.LENGTH):
        self.sched.finish(seq, reason)
        check_consistency(self.pm, self.sched)

    def run_until_outputs(self, seq, num_outputs, max_steps=500):
        for _ in range(max_steps):
            if len(seq.output_token_ids) >= num_outputs:
                return
            self.step()
        raise AssertionError("did not make progress")


def check_page_tables(pm: PageManager, sched: Scheduler) -> None:
    """Right after schedule(): each running sequence holds enough pages for what it will compute."""
    for seq in sched.running:
        assert len(seq.page_table) * pm.page_size >= seq.num_computed_tokens


def check_consistency(pm: PageManager, sched: Scheduler) -> None:
    # Reference counts equal the number of page tables holding each page.
    expected = [0] * pm.num_pages
    for seq in list(sched.running) + list(sched.waiting):
        assert len(set(seq.page_table)) == len(seq.page_table)
        for p in seq.page_table:
            expected[p] += 1
    assert pm.ref_counts == expected
    for seq in sched.waiting:
        assert seq.status is SequenceStatus.WAITING
        assert seq.page_table == [] and seq.num_computed_tokens == 0
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING
        assert seq.num_computed_tokens <= seq.num_tokens
        # Pages held cover exactly the computed tokens, rounded up to whole pages.
        assert len(seq.page_table) == -(-seq.num_computed_tokens // pm.page_size)
    assert len(sched.running) <= sched.max_num_seqs


# -- chunked prefill, decode, budgets ---------------------------------------------------------
def test_chunked_prefill_splits_long_prompt():
    hx = Harness(page_size=4, max_num_batched_tokens=8)
    seq = hx.add(range(100, 120))  # 20 tokens
    chunks = []
    for _ in range(3):
        out = hx.step()
        assert len(out.scheduled) == 1 and out.scheduled[0].seq is seq
        assert out.num_tokens <= 8
        chunks.append(out.scheduled[0].num_new_tokens)
    assert chunks == [8, 8, 4]
    assert seq.num_computed_tokens == 20
    assert seq.output_token_ids == [FAKE_TOKEN]  # only the last chunk sampled
    assert len(seq.page_table) == 5


def test_samples_only_on_last_prefill_chunk():
    hx = Harness(page_size=4, max_num_batched_tokens=8)
    hx.add(range(20))
    flags = []
    for _ in range(4):
        out = hx.sched.schedule()
        flags.append([s.samples for s in out.scheduled])
        hx.sched.finish_step(out)
        for s, f in zip(out.scheduled, flags[-1]):
            if f:
                s.seq.token_ids.append(FAKE_TOKEN)
    assert flags == [[False], [False], [True], [True]]


def test_decode_gets_one_token_per_step():
    hx = Harness(page_size=4, max_num_batched_tokens=64)
    a = hx.add(range(10))
    b = hx.add(range(50, 55))
    out = hx.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 10), (b, 5)]
    for _ in range(5):
        out = hx.sched.schedule()
        assert [(s.seq, s.num_new_tokens, s.samples) for s in out.scheduled] == [(a, 1, True), (b, 1, True)]
        hx.sched.finish_step(out)
        a.token_ids.append(FAKE_TOKEN)
        b.token_ids.append(FAKE_TOKEN)
        check_consistency(hx.pm, hx.sched)
    assert len(a.output_token_ids) == 6 and len(b.output_token_ids) == 6
    assert a.num_computed_tokens == a.num_tokens - 1
    # Pages grow one at a time as decode crosses page boundaries.
    assert len(a.page_table) == -(-a.num_computed_tokens // 4)


def test_running_decodes_scheduled_before_new_prefill_and_budget_shared():
    hx = Harness(page_size=4, max_num_batched_tokens=10)
    a = hx.add(range(6))
    hx.step()  # a prefilled
    b = hx.add(range(100, 130))  # 30-token prompt
    out = hx.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 9)]
    out = hx.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 9)]
    assert out.num_tokens == 10


def test_budget_exhausted_leaves_sequences_waiting():
    hx = Harness(page_size=4, max_num_batched_tokens=8)
    a = hx.add(range(8))
    b = hx.add(range(20, 24))
    out = hx.step()
    assert [s.seq for s in out.scheduled] == [a]
    assert list(hx.sched.waiting) == [b]
    out = hx.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 4)]


def test_max_num_seqs_respected():
    hx = Harness(max_num_seqs=2, max_num_batched_tokens=1000)
    seqs = [hx.add(range(i * 10, i * 10 + 5)) for i in range(5)]
    out = hx.step()
    assert [s.seq for s in out.scheduled] == seqs[:2]
    assert list(hx.sched.waiting) == seqs[2:]
    for _ in range(3):
        out = hx.step()
        assert len(hx.sched.running) == 2
        assert [s.seq for s in out.scheduled] == seqs[:2]
    hx.finish(seqs[0])
    out = hx.step()
    assert [s.seq for s in out.scheduled] == [seqs[1], seqs[2]]
    assert len(hx.sched.running) == 2


def test_admission_blocked_when_pages_short():
    hx = Harness(num_pages=4, page_size=4, max_num_batched_tokens=100)
    a = hx.add(range(12))  # 3 pages
    b = hx.add(range(50, 58))  # needs 2 pages, only 1 left
    out = hx.step()
    assert [s.seq for s in out.scheduled] == [a]
    assert list(hx.sched.waiting) == [b]
    assert b.status is SequenceStatus.WAITING and b.page_table == []
    assert hx.pm.num_free_pages == 1
    assert out.preempted == []
    hx.finish(a)
    out = hx.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(b, 8)]


def test_admission_in_arrival_order_no_skipping():
    # A small later request does not jump a large one that does not fit.
    hx = Harness(num_pages=4, page_size=4, max_num_batched_tokens=100)
    a = hx.add(range(8))  # 2 pages
    big = hx.add(range(100, 112))  # 3 pages: does not fit next to a
    small = hx.add(range(200, 202))  # 1 page: would fit
    out = hx.step()
    assert [s.seq for s in out.scheduled] == [a]
    assert list(hx.sched.waiting) == [big, small]


# -- preemption -------------------------------------------------------------------------------
def test_preempts_newest_running_when_pages_run_out():
    hx = Harness(num_pages=4, page_size=4, max_num_batched_tokens=100)
    a = hx.add(range(8))  # 2 pages, full
    b = hx.add(range(50, 58))  # 2 pages, full
    out = hx.step()
    assert [s.seq for s in out.scheduled] == [a, b]
    assert hx.pm.num_free_pages == 0
    b_pages = list(b.page_table)
    # Next step a's decode needs a 3rd page: none free, so b (newest) is preempted.
    out = hx.sched.schedule()
    assert out.preempted == [b]
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1)]
    assert b.status is SequenceStatus.WAITING
    assert b.page_table == []
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    assert hx.sched.waiting[0] is b
    assert hx.sched.running == [a]
    # b's pages were released (one of them went to a).
    assert all(hx.pm.ref_counts[p] == (1 if p in a.page_table else 0) for p in b_pages)
    assert len(a.page_table) == 3
    hx.sched.finish_step(out)
    check_consistency(hx.pm, hx.sched)


def test_preempted_sequence_goes_to_front_of_waiting():
    hx = Harness(num_pages=4, page_size=4, max_num_batched_tokens=100)
    a = hx.add(range(8))
    b = hx.add(range(50, 58))
    hx.step()
    c = hx.add(range(90, 94))  # arrives later, waits
    out = hx.step()
    assert out.preempted == [b]
    assert list(hx.sched.waiting) == [b, c]
    # No admission in a step that preempted.
    assert [s.seq for s in out.scheduled] == [a]


def test_no_admission_in_a_step_that_preempted():
    # Small budget so a re-admission would only need one page: after b is preempted there are
    # enough free pages for that, but the scheduler must still wait one step.
    hx = Harness(num_pages=4, page_size=4, max_num_batched_tokens=5, prefix=False)
    a = hx.add(range(4))
    b = hx.add(range(50, 58))
    for _ in range(3):
        out = hx.step()
        assert out.preempted == []
    assert (a.num_computed_tokens, b.num_computed_tokens) == (6, 8)
    assert hx.pm.num_free_pages == 0
    out = hx.step()  # b's decode needs a 3rd page: b (newest) is preempted, alone
    assert out.preempted == [b]
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1)]
    assert list(hx.sched.waiting) == [b]
    assert hx.pm.num_free_pages == 2  # a 4-token chunk of b would fit...
    out = hx.step()  # ...and is admitted on the next step
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 4)]


def test_preempted_sequence_keeps_tokens_and_recomputes():
    hx = Harness(num_pages=5, page_size=4, max_num_batched_tokens=100, prefix=False)
    a = hx.add(range(8))
    b = hx.add(range(50, 58))
    hx.step()  # both prefilled, one output each; 4 pages in use, 1 free
    hx.step()  # a and b cross into page 3: a gets the last free page, b is preempted
    assert b.num_preemptions == 1
    b_tokens = list(b.token_ids)
    assert b_tokens == list(range(50, 58)) + [FAKE_TOKEN]
    hx.finish(a)
    out = hx.step()
    # b is re-admitted and recomputes everything it had, prompt and output, in one go.
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(b, 9)]
    assert b.token_ids == b_tokens + [FAKE_TOKEN]  # it sampled again after recomputing
    assert b.status is SequenceStatus.RUNNING
    hx.finish(b)
    assert hx.pm.num_referenced_pages == 0


def test_sequence_that_cannot_fit_alone_is_preempted_not_crashing():
    hx = Harness(num_pages=2, page_size=4, max_num_batched_tokens=100)
    a = hx.add(range(8))  # exactly 2 pages
    hx.step()
    out = hx.step()  # the decode needs a 3rd page that does not exist
    assert out.preempted == [a]
    assert out.scheduled == []
    assert a.status is SequenceStatus.WAITING and a.page_table == []
    assert hx.pm.num_referenced_pages == 0


def test_preemption_takes_multiple_newest_until_fits():
    hx = Harness(num_pages=6, page_size=4, max_num_batched_tokens=100, max_num_seqs=8)
    a = hx.add(range(4))  # 1 page each, full
    b = hx.add(range(10, 14))
    c = hx.add(range(20, 24))
    hx.step()
    # Fill the remaining 3 pages by letting a hold them artificially.
    extra = hx.pm.allocate(3)
    out = hx.sched.schedule()
    # a needs a page: c is preempted (its page goes to a); b then needs a page: b is the newest, so b itself goes.
    assert out.preempted == [c, b]
    assert [s.seq for s in out.scheduled] == [a]
    assert list(hx.sched.waiting) == [b, c]
    hx.pm.release(extra)


# -- prefix cache on admission ----------------------------------------------------------------
def test_prefix_hit_on_admission_full_pages():
    hx = Harness(page_size=4, max_num_batched_tokens=100)
    prompt = list(range(300, 310))  # 10 tokens: 2 full pages + 2
    a = hx.add(prompt)
    hx.step()
    assert hx.pm.num_cached_pages == 2
    b = hx.add(prompt)
    out = hx.step()
    sb = [s for s in out.scheduled if s.seq is b][0]
    assert b.num_cached_prompt_tokens == 8
    assert sb.num_new_tokens == 2
    assert b.output_token_ids == [FAKE_TOKEN]  # the step completed b's prompt and sampled
    assert b.page_table[:2] == a.page_table[:2]  # shared pages
    assert b.page_table[2] != a.page_table[2]
    assert all(hx.pm.ref_counts[p] == 2 for p in a.page_table[:2])
    assert hx.pm.prefix_hit_tokens == 8
    assert hx.pm.prefix_queries_tokens == 20


def test_prefix_hit_never_covers_whole_prompt():
    hx = Harness(page_size=4, max_num_batched_tokens=100)
    prompt = list(range(400, 412))  # exactly 3 full pages
    a = hx.add(prompt)
    hx.step()
    assert hx.pm.num_cached_pages == 3
    hx.finish(a)
    b = hx.add(prompt)
    out = hx.step()
    # Only 2 of the 3 cached pages are used: the last token must be computed to sample.
    assert b.num_cached_prompt_tokens == 8
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(b, 4)]
    assert b.output_token_ids == [FAKE_TOKEN]


def test_one_token_prompt_gets_no_hit():
    hx = Harness(page_size=1, max_num_batched_tokens=100)
    a = hx.add([5])
    hx.step()
    hx.finish(a)
    b = hx.add([5])
    out = hx.step()
    assert b.num_cached_prompt_tokens == 0
    assert out.scheduled[0].num_new_tokens == 1


def test_prefix_hit_on_evictable_pages_after_first_finished():
    hx = Harness(num_pages=4, page_size=4, max_num_batched_tokens=100)
    prompt = list(range(500, 514))  # 14 tokens: 3 full pages + 2 -> 4 pages
    a = hx.add(prompt)
    hx.step()
    hx.finish(a)
    assert hx.pm.num_referenced_pages == 0 and hx.pm.num_cached_pages == 3
    b = hx.add(prompt)
    out = hx.step()
    assert b.num_cached_prompt_tokens == 12
    assert out.scheduled[0].num_new_tokens == 2
    assert hx.pm.num_referenced_pages == 4


def test_prefix_hit_admission_counts_evictable_hits_against_free_pool():
    # 4 pages. a leaves 3 cached (evictable) pages; c takes the one plain free page. b hits 2 of
    # a's pages and needs 2 more: acquiring the hits leaves only 1 in the pool, so b must wait
    # (checking only the 2 new pages against the 3 "free" would over-commit and crash).
    hx = Harness(num_pages=4, page_size=4, max_num_batched_tokens=100)
    prefix = list(range(600, 608))
    a = hx.add(prefix + [1, 2, 3, 4])  # 3 full pages, all registered
    hx.step()
    a_pages = list(a.page_table)
    hx.finish(a)
    assert hx.pm.num_cached_pages == 3 and hx.pm.num_free_pages == 4
    c = hx.add(range(700, 703))  # 1 page (room for its next decode): from the free list
    hx.step()
    assert hx.pm.match_prefix(hash_full_pages(a.token_ids, 4)) == a_pages
    assert hx.pm.num_free_pages == 3  # all three are a's evictable pages
    b = hx.add(prefix + [9, 9, 9, 9, 9])  # 13 tokens: 2 hits + 2 new pages
    out = hx.step()  # must not raise OutOfPagesError
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(c, 1)]
    assert hx.pm.match_prefix(hash_full_pages(a.token_ids, 4)) == a_pages  # nothing evicted
    assert list(hx.sched.waiting) == [b]
    hx.finish(c)
    out = hx.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(b, 5)]
    assert b.num_cached_prompt_tokens == 8
    assert b.page_table[:2] == a_pages[:2]


def test_no_prefix_hits_when_disabled():
    hx = Harness(page_size=4, max_num_batched_tokens=100, prefix=False)
    prompt = list(range(10))
    a = hx.add(prompt)
    hx.step()
    b = hx.add(prompt)
    hx.step()
    assert b.num_cached_prompt_tokens == 0
    assert set(a.page_table).isdisjoint(b.page_table)
    assert hx.pm.num_cached_pages == 0


def test_finish_step_registers_full_pages_with_chained_hashes():
    hx = Harness(page_size=4, max_num_batched_tokens=6)
    seq = hx.add(range(800, 814))  # 14 tokens
    hx.step()  # 6 computed: 1 full page
    assert len(seq.page_hashes) == 1
    hx.step()  # 12 computed: 3 full pages
    assert seq.page_hashes == hash_full_pages(seq.token_ids[:12], 4)
    assert hx.pm.match_prefix(seq.page_hashes) == seq.page_table[:3]


def test_preempted_then_readmitted_sequence_uses_cache_and_reregisters():
    # page_size 4, 5 pages. a and b each fill 2 pages; decoding pushes b out.
    hx = Harness(num_pages=5, page_size=4, max_num_batched_tokens=100)
    a = hx.add(range(8))
    b = hx.add(range(50, 58))
    hx.step()
    hx.step()  # b preempted; its 2 full pages stay cached (evictable)
    assert b.num_preemptions == 1
    assert hx.pm.num_cached_pages >= 2
    hx.finish(a)
    out = hx.step()
    # Re-admission hits b's cached prompt pages: only the generated token is recomputed.
    assert b.num_cached_prompt_tokens == 8
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(b, 1)]
    hx.finish(b)
    assert hx.pm.num_referenced_pages == 0


def test_recomputed_pages_after_preemption_are_registered_again():
    hx = Harness(num_pages=4, page_size=4, max_num_batched_tokens=100)
    a = hx.add(range(8))  # 2 pages
    b = hx.add(range(50, 58))  # 2 pages
    hx.step()
    hx.step()  # a needs a 3rd page: b preempted, its 2 registered pages become evictable
    assert b.num_preemptions == 1
    # Let a consume every page, evicting b's cached pages.
    hx.run_until_outputs(a, 6)  # a: 8 + 5 computed tokens -> 4 pages
    assert hx.pm.match_prefix(hash_full_pages(list(range(50, 58)), 4)) == []
    hx.finish(a)
    hx.step()  # b re-admitted: nothing cached, recomputes its 9 tokens (2 full pages)
    assert b.num_computed_tokens == 9
    hx.finish(b)
    # b's recomputed full pages must be in the prefix cache again.
    assert len(hx.pm.match_prefix(hash_full_pages(b.token_ids, 4)[:2])) == 2


# -- finish -----------------------------------------------------------------------------------
def test_finish_releases_pages_once_and_is_idempotent():
    hx = Harness(page_size=4)
    a = hx.add(range(10))
    hx.step()
    assert hx.pm.num_referenced_pages == 3
    hx.finish(a, FinishReason.STOP)
    assert a.status is SequenceStatus.FINISHED and a.is_finished
    assert a.finish_reason is FinishReason.STOP
    assert a.page_table == []
    assert hx.pm.num_referenced_pages == 0
    assert hx.sched.running == [] and not hx.sched.has_unfinished()
    free = hx.pm.num_free_pages
    hx.finish(a, FinishReason.ABORT)  # no double release (would raise), reason unchanged
    assert a.finish_reason is FinishReason.STOP
    assert hx.pm.num_free_pages == free


def test_finish_waiting_sequence():
    hx = Harness(max_num_seqs=1)
    a = hx.add(range(4))
    b = hx.add(range(10, 14))
    hx.step()
    assert list(hx.sched.waiting) == [b]
    hx.finish(b, FinishReason.ABORT)
    assert list(hx.sched.waiting) == []
    assert b.finish_reason is FinishReason.ABORT
    hx.finish(a)
    assert not hx.sched.has_unfinished()
    assert hx.pm.num_referenced_pages == 0


def test_finish_shared_prefix_keeps_pages_for_other_sequence():
    hx = Harness(page_size=4)
    prompt = list(range(900, 910))
    a = hx.add(prompt)
    hx.step()
    b = hx.add(prompt)
    hx.step()
    shared = b.page_table[:2]
    hx.finish(a)
    assert all(hx.pm.ref_counts[p] == 1 for p in shared)
    hx.finish(b)
    assert hx.pm.num_referenced_pages == 0
    assert hx.pm.num_free_pages == hx.pm.num_pages


@pytest.mark.parametrize("prefix", [True, False])
def test_mixed_workload_no_page_leak(prefix):
    import random

    rng = random.Random(1)
    hx = Harness(num_pages=12, page_size=4, max_num_seqs=4, max_num_batched_tokens=16, prefix=prefix)
    shared = list(range(1000, 1008))
    targets = {}  # request id -> (seq, number of outputs it stops at)
    for i in range(10):
        prompt = (shared if i % 2 else []) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        seq = hx.add(prompt)
        targets[seq.request_id] = (seq, rng.randrange(1, 8))
    preemptions = 0
    for _ in range(1000):
        if not hx.sched.has_unfinished():
            break
        out = hx.step()
        preemptions += len(out.preempted)
        for seq in list(hx.sched.running):
            if len(seq.output_token_ids) >= targets[seq.request_id][1]:
                hx.finish(seq)
    assert not hx.sched.has_unfinished()
    for seq, n in targets.values():
        assert seq.is_finished and len(seq.output_token_ids) == n
    assert hx.pm.num_referenced_pages == 0
    assert hx.pm.num_free_pages == hx.pm.num_pages
    assert preemptions == sum(seq.num_preemptions for seq, _ in targets.values())
    if prefix:
        assert hx.pm.prefix_hit_tokens > 0
