"""Prompt lookup (n-gram) proposals: what followed the last n tokens the previous time they occurred.

Code, extraction and edits repeat their context; when the last n tokens of a sequence (n from
ngram_max down to ngram_min) appeared earlier in its prompt or output, the tokens that followed
that most recent earlier occurrence are a good guess for what comes next. No model runs: each
speculating sequence keeps an index of its n-grams (`NgramIndex`), extended by the tokens it
gained since its last step, so a lookup is a few dictionary reads.

Why an index: `find_continuation`, the same rule as a scan over the tokens, took ~75 us a step
on a 300-token sequence (builtin:code-small, 2-core Zen 4), 5% of a speculating step at
concurrency 1, where the index takes a few us. The scan stays as the rule's reference (tests
check the two agree).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import numpy as np

from engine.spec.proposer import NO_PROPOSAL, BaseProposer, Proposal

if TYPE_CHECKING:
    from engine.sequence import Sequence


def find_continuation(token_ids: Seq[int] | np.ndarray, k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix
    (ngram_max down to ngram_min tokens) of `token_ids` that occurred before; [] when none did."""
    num_tokens = len(token_ids)
    if k <= 0 or num_tokens <= ngram_min:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)  # [num_tokens]
    for n in range(min(ngram_max, num_tokens - 1), ngram_min - 1, -1):
        suffix = tokens[num_tokens - n:]
        # Starts i of earlier occurrences: i + n <= num_tokens - 1, so a token follows each.
        # Filter by one column at a time: after the first, few candidates are left.
        starts = np.flatnonzero(tokens[: num_tokens - n] == suffix[0])
        for j in range(1, n):
            if not starts.size:
                break
            starts = starts[tokens[starts + j] == suffix[j]]
        if starts.size:
            follow = int(starts[-1]) + n
            return tokens[follow : follow + k].tolist()
    return []


class NgramIndex:
    """One sequence's n-grams (1 to `ngram_max` tokens) that a token follows, each with its most
    recent start: what `find_continuation` scans for, kept up to date as the sequence grows (its
    tokens only ever grow: proposals are verified outside them)."""

    def __init__(self, ngram_max: int) -> None:
        self.ngram_max = ngram_max
        self.starts: dict[tuple[int, ...], int] = {}
        self.num_followed = 0  # n-grams ending before token num_followed - 1 are in `starts`

    def extend(self, token_ids: Seq[int]) -> None:
        """Adds the n-grams that tokens appended since the last call now follow."""
        starts, n_max = self.starts, self.ngram_max
        for follower in range(max(self.num_followed, 1), len(token_ids)):
            for n in range(1, min(n_max, follower) + 1):
                starts[tuple(token_ids[follower - n : follower])] = follower - n  # later starts overwrite
        self.num_followed = max(self.num_followed, len(token_ids))

    def continuation(self, token_ids: Seq[int], k: int, ngram_min: int) -> list[int]:
        """find_continuation(token_ids, k, ngram_min, self.ngram_max) for the tokens this index
        has followed (`extend` first)."""
        num_tokens = len(token_ids)
        if k <= 0 or num_tokens <= ngram_min:
            return []
        for n in range(min(self.ngram_max, num_tokens - 1), ngram_min - 1, -1):
            start = self.starts.get(tuple(token_ids[num_tokens - n :]))
            if start is not None:
                follow = start + n
                return list(token_ids[follow : follow + k])
        return []


class PromptLookupProposer(BaseProposer):
    method = "prompt_lookup"
    free_proposals = True  # a few dictionary reads, whatever k

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.indexes: dict[str, NgramIndex] = {}  # by request id, until `release`

    def propose(self, seqs: Seq[Sequence], max_num_tokens: Seq[int]) -> list[Proposal]:
        proposals = []
        for seq, k in zip(seqs, max_num_tokens):
            index = self.indexes.get(seq.request_id)
            if index is None:
                index = self.indexes[seq.request_id] = NgramIndex(self.ngram_max)
            index.extend(seq.token_ids)
            found = index.continuation(seq.token_ids, k, self.ngram_min)
            proposals.append(Proposal(tuple(found)) if found else NO_PROPOSAL)
        return proposals

    def release(self, seq: Sequence) -> None:
        self.indexes.pop(seq.request_id, None)
