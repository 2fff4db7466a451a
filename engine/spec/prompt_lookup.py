"""Prompt lookup (n-gram) proposals: what followed the last n tokens the previous time they occurred.

Code, extraction and edits repeat their context; when the last n tokens of a sequence (n from
ngram_max down to ngram_min) appeared earlier in its prompt or output, the tokens that followed
that most recent earlier occurrence are a good guess for what comes next. No model runs: a few
numpy comparisons over the sequence's tokens, once per step per speculating sequence.
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


class PromptLookupProposer(BaseProposer):
    method = "prompt_lookup"
    free_proposals = True  # a few numpy comparisons, whatever k

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose(self, seqs: Seq[Sequence], max_num_tokens: Seq[int]) -> list[Proposal]:
        proposals = []
        for seq, k in zip(seqs, max_num_tokens):
            found = find_continuation(seq.token_ids, k, self.ngram_min, self.ngram_max)
            proposals.append(Proposal(tuple(found)) if found else NO_PROPOSAL)
        return proposals
