"""engine/spec/fallback_proposer.py with stand-in proposers: who proposes, labels, routing of
`on_verified`, the fallback's own adaptive k, and forgetting a released sequence."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from engine import SamplingParams
from engine.sequence import Sequence
from engine.spec.adaptive import SpecState
from engine.spec.fallback_proposer import FallbackProposer
from engine.spec.proposer import NO_PROPOSAL, BaseProposer, Proposal


class Scripted(BaseProposer):
    """Proposes `answers[request_id]` (cut to k); records the hooks it gets."""

    def __init__(self, method: str, answers: dict[str, tuple[int, ...]]) -> None:
        self.method, self.answers = method, answers
        self.asked: list[tuple[str, int]] = []
        self.verified: list[tuple[str, int]] = []
        self.released: list[str] = []

    def propose(self, seqs: Seq[Sequence], max_num_tokens: Seq[int]) -> list[Proposal]:
        self.asked += [(s.request_id, k) for s, k in zip(seqs, max_num_tokens)]
        return [Proposal(self.answers[s.request_id][:k]) if self.answers.get(s.request_id) else NO_PROPOSAL
                for s, k in zip(seqs, max_num_tokens)]

    def on_verified(self, seq: Sequence, num_accepted: int) -> None:
        self.verified.append((seq.request_id, num_accepted))

    def release(self, seq: Sequence) -> None:
        self.released.append(seq.request_id)


def seq(request_id: str) -> Sequence:
    return Sequence(request_id, [1, 2, 3], SamplingParams(), 3, 64)


def test_the_primary_where_it_has_guesses_else_the_fallback_labelled_by_who_proposed():
    primary, fallback = Scripted("lookup", {"a": (5, 6)}), Scripted("draft", {"b": (7, 8, 9)})
    hybrid = FallbackProposer(primary, fallback)
    assert hybrid.method == "lookup+draft" and hybrid.free_proposals
    a, b = seq("a"), seq("b")
    proposals = hybrid.propose([a, b], [4, 4])
    assert [p.token_ids for p in proposals] == [(5, 6), (7, 8, 9)]
    assert [p.proposed_by for p in proposals] == ["lookup", "draft"]
    assert fallback.asked == [("b", 4)]  # never asked for a sequence the primary served
    hybrid.on_verified(a, 1)
    hybrid.on_verified(b, 2)
    assert primary.verified == [("a", 1)] and fallback.verified == [("b", 2)]
    hybrid.on_verified(b, 0)  # nothing pending: nobody hears of it
    assert fallback.verified == [("b", 2)]


def test_the_fallbacks_k_follows_its_own_misses_and_a_release_forgets_the_sequence():
    primary, fallback = Scripted("lookup", {}), Scripted("draft", {"b": (7, 8, 9, 10)})
    fallback.guess_cost = 0.3
    hybrid = FallbackProposer(primary, fallback)
    assert hybrid.guess_cost == 0.0  # the method's own k: the primary's guesses are free
    b = seq("b")
    first = len(hybrid.propose([b], [4])[0])
    assert first == SpecState("draft", 4, guess_cost=0.3).next_k()  # the fallback's cost, not the primary's
    hybrid.on_verified(b, 0)
    misses = 1
    while hybrid.propose([b], [4]) != [NO_PROPOSAL]:  # total misses: the rate falls ...
        hybrid.on_verified(b, 0)
        misses += 1
    assert 2 < misses < 10  # ... until even one guess does not pay: a pause of one step
    assert hybrid.propose([b], [4]) == [NO_PROPOSAL]
    assert len(hybrid.propose([b], [4])[0]) == 1  # then a probe
    ks = [1]
    for _ in range(10):
        hybrid.on_verified(b, ks[-1])  # every guess right: the rate climbs, k grows again
        ks.append(len(hybrid.propose([b], [4])[0]))
    assert ks == sorted(ks) and ks[-1] == 4
    hybrid.release(b)
    assert not hybrid.pending and not hybrid.fallback_states
    assert primary.released == ["b"] and fallback.released == ["b"]


def test_a_prompt_computed_by_the_fallback_is_the_methods_until_its_next_call():
    """The speculator leaves a step whose proposer computed prompt KV out of the cost policy's
    means (engine/spec/cost_policy.py): the flag must come through the fallback method."""
    primary, fallback = Scripted("lookup", {"a": (5,)}), Scripted("draft", {"b": (7,)})
    hybrid = FallbackProposer(primary, fallback)
    fallback.computed_prompt = True  # as a draft's first catch-up leaves it
    hybrid.propose([seq("a")], [2])  # the primary served it: the fallback did not run
    assert not hybrid.computed_prompt
    hybrid.propose([seq("b")], [2])
    assert hybrid.computed_prompt
