"""Iteration-level scheduling: who runs in the next step, with how many tokens each.

The engine calls `schedule()` before every model step and `finish_step()` after it. All
policy lives in `schedule()`, read top to bottom:
  1. Running sequences first, oldest first. Each gets the tokens it still needs (one for a
     decode, the rest of its prompt for a prefill), capped by the step's token budget
     (chunked prefill). If its pages cannot be allocated, the newest running sequence is
     preempted (pages released, recomputed later from its tokens) until they can.
  2. Then waiting sequences, in arrival order, while the budget, `max_num_seqs` and free
     pages allow: prefix-cache hits are taken first, only the rest is computed.
No waiting sequence is admitted in a step that preempted: pages are short.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from engine.page_manager import PageManager
from engine.sequence import FinishReason, Sequence, SequenceStatus
from engine.spec.proposer import Proposal
from proto.block_hash import ROOT_HASH, hash_full_pages


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    # Tokens to compute this step, starting at seq.num_computed_tokens: the sequence's own,
    # then the proposed ones of `draft` (speculative decoding: engine/spec/speculator.py).
    num_new_tokens: int
    draft: Proposal | None = None
    spec_method: str = ""  # the proposer of `draft`

    @property
    def num_draft_tokens(self) -> int:
        return 0 if self.draft is None else len(self.draft)

    @property
    def samples(self) -> bool:
        """Whether this step completes the sequence's known tokens, so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens + self.num_draft_tokens

    def with_draft(self, draft: Proposal, method: str) -> ScheduledSeq:
        return replace(self, num_new_tokens=self.num_new_tokens + len(draft), draft=draft, spec_method=method)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, page_manager: PageManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.pages = page_manager
        self.page_size = page_manager.page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # lifetime total, for tests and metrics

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        # 1. Running sequences, oldest first; preempt from the newest end when pages run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            need = self._pages_needed(seq, num_new)
            while not self.pages.can_allocate(need) and self.running[-1] is not seq:
                out.preempted.append(self._preempt(self.running.pop()))
            if not self.pages.can_allocate(need):
                # Even alone it does not fit this step: it waits for pages to be freed.
                out.preempted.append(self._preempt(self.running.pop()))
                break
            seq.page_table += self.pages.allocate(need)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            i += 1

        # 2. Waiting sequences, in arrival order (preempted ones were put back at the front).
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            hits, hit_hashes = self._prefix_hits(seq)
            num_cached = len(hits) * self.page_size
            num_new = min(seq.num_tokens - num_cached, budget)
            need = self._pages_needed_from(len(hits), num_cached + num_new)
            if not self.pages.can_allocate(need + self.pages.num_evictable_among(hits)):
                break
            self.waiting.popleft()
            self.pages.acquire(hits)
            if seq.num_preemptions == 0:  # the hit rate is about prompts, not re-admissions
                self.pages.record_lookup(seq.num_prompt_tokens, num_cached)
            seq.page_table = hits + self.pages.allocate(need)
            seq.page_hashes = hit_hashes
            seq.num_computed_tokens = num_cached
            # A re-admission may also hit its own generated tokens; count only the prompt's.
            seq.num_cached_prompt_tokens = min(num_cached, seq.num_prompt_tokens)
            seq.status = SequenceStatus.RUNNING
            # `running` stays in arrival order (its tail, the newest, is the preemption victim)
            # with a plain append: victims are taken newest first and re-admitted oldest first,
            # so a re-admitted sequence is always newer than everything still running.
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return out

    def finish_step(self, out: SchedulerOutput) -> None:
        """Advances progress of every scheduled sequence and registers its newly full pages.
        Proposed tokens do not count yet: `commit_drafts` adds those the verification kept."""
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens - s.num_draft_tokens
            self.register_full_pages(s.seq)

    # -- speculative decoding (engine/spec/speculator.py) -----------------------------------------
    def allocate_drafts(self, seq: Sequence, num_draft_tokens: int) -> bool:
        """Pages for a scheduled decode's proposed tokens, if free ones allow (never preempts)."""
        need = self._pages_needed(seq, 1 + num_draft_tokens)
        if not self.pages.can_allocate(need):
            return False
        seq.page_table += self.pages.allocate(need)
        return True

    def commit_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """After verification appended the kept tokens: their KV counts as computed; the pages
        past what the next step needs (they hold only rejected positions) go back, and the
        newly full pages, all of accepted tokens, enter the prefix cache."""
        seq.num_computed_tokens += num_accepted
        keep = -(-seq.num_tokens // self.page_size)  # through the token the next step computes
        if len(seq.page_table) > keep:
            self.pages.release(reversed(seq.page_table[keep:]))
            del seq.page_table[keep:]
        self.register_full_pages(seq)

    def finish(self, seq: Sequence, reason: FinishReason, keep_pages: bool = False) -> list[int]:
        """Moves a sequence to its terminal state and releases its pages (exactly once). With
        `keep_pages`, the pages stay referenced and are returned: the caller now owns them
        (a prefill worker holding KV until its transfer ends)."""
        if seq.is_finished:
            return []
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        kept = list(seq.page_table) if keep_pages else []
        if keep_pages:
            seq.page_table, seq.page_hashes = [], []
        else:
            self._release_pages(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        return kept

    def add_running(self, seq: Sequence) -> None:
        """Joins a sequence whose KV is already in its pages (computed elsewhere) to the batch."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)  # newest arrival: arrival order holds
        self.register_full_pages(seq)

    # -- helpers ----------------------------------------------------------------------------
    def _pages_needed(self, seq: Sequence, num_new: int) -> int:
        return self._pages_needed_from(len(seq.page_table), seq.num_computed_tokens + num_new)

    def _pages_needed_from(self, num_pages_held: int, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - num_pages_held)

    def _prefix_hits(self, seq: Sequence) -> tuple[list[int], list[bytes]]:
        """Cached pages holding the sequence's leading full pages, and those pages' hashes."""
        if not self.pages.enable_prefix_caching:
            return [], []
        # At least one token must be computed, or there would be no logits to sample from.
        max_pages = (seq.num_tokens - 1) // self.page_size
        hashes = hash_full_pages(seq.token_ids[: max_pages * self.page_size], self.page_size)
        hits = self.pages.match_prefix(hashes)
        return hits, hashes[: len(hits)]

    def _release_pages(self, seq: Sequence) -> None:
        # Last page first: LRU then evicts a prefix from its tail, so what stays cached is
        # always a usable prefix (an evicted first page would strand every page after it).
        self.pages.release(reversed(seq.page_table))
        seq.page_table = []
        seq.page_hashes = []

    def register_full_pages(self, seq: Sequence) -> None:
        if not self.pages.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.page_size
        if num_full <= len(seq.page_hashes):
            return
        parent = seq.page_hashes[-1] if seq.page_hashes else ROOT_HASH
        new = hash_full_pages(seq.token_ids[: num_full * self.page_size], self.page_size,
                              start_page=len(seq.page_hashes), parent=parent)
        for index, page_hash in enumerate(new, start=len(seq.page_hashes)):
            self.pages.register(seq.page_table[index], page_hash)
        seq.page_hashes += new

    def _preempt(self, seq: Sequence) -> Sequence:
        # Recompute-style preemption: drop the KV, keep the tokens. The pages it filled stay in
        # the prefix cache (if enabled), so re-admission often recomputes little.
        self._release_pages(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        return seq
