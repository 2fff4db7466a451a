"""engine/spec: the prompt-lookup proposer, a lone request's k, and the speculative settings
(engine config and SamplingParams) with their errors (the adaptive k: test_adaptive_k.py)."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from configs import EngineSettings
from engine.sampling_params import SamplingParams
from engine.spec.prompt_lookup import NgramIndex, PromptLookupProposer, find_continuation


def test_proposes_what_followed_the_longest_suffix_match():
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [9, 1, 2, 3, 7, 8, 1, 2, 3]
    # suffix [1, 2, 3] occurred at 1..3, followed by 7, 8, 1, ...
    assert find_continuation(tokens, 3, 1, 3) == [7, 8, 1]
    assert find_continuation(tokens, 10, 1, 3) == [7, 8, 1, 2, 3]  # up to the end, never past it


def test_the_most_recent_earlier_match_wins():
    tokens = [5, 1, 2, 5, 3, 4, 5]
    assert find_continuation(tokens, 2, 1, 1) == [3, 4]  # not [1, 2] after the first 5


def test_longer_ngrams_take_precedence_over_more_recent_short_ones():
    # [2, 5] occurs at 0 (followed by 6); the 1-gram [5] occurs more recently at 4 (followed by 9).
    tokens = [2, 5, 6, 0, 5, 9, 3, 2, 5]
    assert find_continuation(tokens, 2, 1, 2) == [6, 0]
    assert find_continuation(tokens, 2, 1, 1) == [9, 3]
    assert find_continuation(tokens, 2, 2, 2) == [6, 0]


def test_no_match_no_proposal():
    assert find_continuation([1, 2, 3, 4], 4, 1, 3) == []
    assert find_continuation([1, 2, 3, 1], 0, 1, 3) == []  # k = 0
    assert find_continuation([1], 4, 1, 3) == []  # nothing before the suffix
    # only a 1-gram repeats, but the proposer wants at least 2
    assert find_continuation([4, 5, 6, 4], 3, 2, 3) == []


def test_a_match_must_lie_before_the_suffix_itself():
    # A cycle of period 1: the suffix [7] matched at 2 is followed by the final 7.
    assert find_continuation([1, 7, 7], 3, 1, 3) == [7]
    assert find_continuation([1, 7], 3, 1, 3) == []


class Seq:
    def __init__(self, request_id, tokens):
        self.request_id, self.token_ids = request_id, tokens


def test_proposer_caps_each_sequence_at_its_k():
    proposer = PromptLookupProposer(1, 3)
    seqs = [Seq("a", [1, 2, 3, 4, 1]), Seq("b", [6, 6, 6]), Seq("c", [8, 9])]
    proposals = proposer.propose(seqs, [2, 5, 3])
    assert [p.token_ids for p in proposals] == [(2, 3), (6,), ()]
    assert all(p.draft_probs is None for p in proposals)  # point masses
    with pytest.raises(ValueError):
        PromptLookupProposer(3, 2)


def test_the_index_proposes_what_the_scan_finds_as_a_sequence_grows():
    # Small vocabularies repeat often (matches of every length); a large one rarely (no match).
    rng = random.Random(0)
    for vocab, ngram_min, ngram_max, k in ((3, 1, 3, 4), (5, 2, 3, 5), (4, 1, 1, 2), (50, 1, 4, 8), (9, 3, 6, 3)):
        index = NgramIndex(ngram_max)
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
        for _ in range(120):
            index.extend(tokens)
            want = find_continuation(tokens, k, ngram_min, ngram_max)
            assert index.continuation(tokens, k, ngram_min) == want, (vocab, tokens)
            tokens += [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]  # an accepted run


def test_a_released_sequence_leaves_no_index():
    proposer = PromptLookupProposer(1, 3)
    seq = Seq("r1", [4, 5, 6, 4, 5])
    assert proposer.propose([seq], [3])[0].token_ids == (6, 4, 5)
    seq.token_ids += [7, 4, 5]  # the index follows what the sequence gained
    assert proposer.propose([seq], [3])[0].token_ids == (7, 4, 5)
    assert set(proposer.indexes) == {"r1"}
    proposer.release(seq)
    assert proposer.indexes == {}


def test_speculative_settings_are_validated():
    s = EngineSettings.model_validate({"speculative": {"method": "prompt_lookup", "num_tokens": 6,
                                                       "ngram_min": 2, "ngram_max": 4}})
    assert (s.speculative.method, s.speculative.num_tokens, s.speculative.ngram_min) == ("prompt_lookup", 6, 2)
    assert EngineSettings().speculative.method == "none"
    for bad, message in (({"method": "medusa"}, "method"), ({"num_tokens": 0}, "num_tokens"),
                         ({"num_tokens": 17}, "num_tokens"), ({"ngram_min": 3, "ngram_max": 2}, "ngram_min"),
                         ({"k": 3}, "k")):
        with pytest.raises(ValidationError, match=message):
            EngineSettings.model_validate({"speculative": bad})


def test_sampling_params_speculative_fields():
    assert SamplingParams(speculative_method="prompt_lookup", num_speculative_tokens=0).num_speculative_tokens == 0
    with pytest.raises(ValueError, match="speculative_method must be one of none, prompt_lookup"):
        SamplingParams(speculative_method="eagle")
    for bad in (-1, 17, True, 2.0):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            SamplingParams(num_speculative_tokens=bad)


def test_a_lone_request_proposes_every_step_after_misses():
    """Speculator.plan asks for the maximum k for the step's only sequence when its proposer's
    guesses are free (prompt lookup), though its acceptance would pause it in a shared step."""
    from configs.engine import SpeculativeConfig
    from engine.sampling_params import SamplingParams
    from engine.scheduler import ScheduledSeq, SchedulerOutput
    from engine.sequence import Sequence
    from engine.spec.speculator import Speculator

    class Recorder(PromptLookupProposer):
        def __init__(self):
            super().__init__(1, 3)
            self.asked: list[list[int]] = []

        def propose(self, seqs, max_num_tokens):
            self.asked.append(list(max_num_tokens))
            return super().propose(seqs, max_num_tokens)

    class Pages:
        max_num_batched_tokens = 512

        def allocate_drafts(self, seq, n):
            return True

    recorder = Recorder()
    spec = Speculator(SpeculativeConfig(method="prompt_lookup", num_tokens=4, cost_policy=False),
                      {"prompt_lookup": recorder})
    seq = Sequence("a", [1, 2, 3, 1, 2], SamplingParams(max_tokens=32), 0, 1024)
    seq.token_ids.append(3)
    seq.num_computed_tokens = seq.num_tokens - 1
    seq.spec = spec.state_of(seq)
    assert seq.spec is not None
    for _ in range(20):
        seq.spec.record(4, 0)  # so bad a rate that a shared step would pause it
    assert seq.spec.next_k(num_step_seqs=2) == 0 and seq.spec.pause_steps == 1
    spec.plan(SchedulerOutput([ScheduledSeq(seq, 1)]), Pages())  # type: ignore[arg-type]
    assert recorder.asked == [[4]]
    assert seq.spec.pause_steps == 1  # the pause is kept for the next shared step
