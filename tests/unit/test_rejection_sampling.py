"""engine/spec/rejection.py: greedy verification, and that speculative (rejection) sampling
draws exactly from the target's distribution, checked by chi-square tests over many seeded
draws on a small vocabulary. A naive rule (accept every proposal) is run through the same test
and must fail it: the test can tell."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams
from engine.spec.rejection import rejection_sample, target_probs, verify_greedy

VOCAB = 8
DRAWS = 6000


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of observed `counts` under `probs` (Pearson; categories with p = 0 must be empty)."""
    expected = probs * counts.sum()
    support = expected > 0
    assert counts[~support].sum() == 0, "a token the target never draws was emitted"
    stat = float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


def test_greedy_accepts_the_matching_prefix_then_the_targets_token():
    logits = torch.full((4, VOCAB), -1.0)
    for row, token in enumerate([3, 5, 1, 6]):
        logits[row, token] = 2.0
    assert verify_greedy(logits, [3, 5, 1]) == ([3, 5, 1, 6], 3)  # all accepted + the bonus token
    assert verify_greedy(logits, [3, 4, 1]) == ([3, 5], 1)  # the target's token at the first mismatch
    assert verify_greedy(logits, [0, 5, 1]) == ([3], 0)
    assert verify_greedy(logits[:1], []) == ([3], 0)  # no proposal: plain greedy


def target_logits() -> torch.Tensor:
    torch.manual_seed(3)
    return torch.randn(3, VOCAB) * 1.5  # [k + 1, vocab] for k = 2


def emitted_counts(probs, draft, draft_probs, position: int, given_first: int | None = None,
                   rule=rejection_sample) -> torch.Tensor:
    counts = torch.zeros(VOCAB)
    for seed in range(DRAWS):
        tokens, _ = rule(probs, draft, draft_probs, torch.Generator().manual_seed(seed))
        if given_first is not None and tokens[0] != given_first:
            continue
        if len(tokens) > position:
            counts[tokens[position]] += 1
    return counts


def test_point_mass_proposals_leave_the_first_token_distributed_as_the_target():
    params = SamplingParams(temperature=0.9, top_k=6)
    probs = target_probs(target_logits(), params)
    for draft in ([int(probs[0].argmax()), 2], [int(probs[0].argmin()), 2], [int(probs[0].argsort()[-3]), 4]):
        counts = emitted_counts(probs, draft, None, 0)
        assert chi_square_p_value(counts, probs[0]) > 1e-3, (draft, counts)


def test_the_second_token_given_the_first_was_accepted_is_distributed_as_the_target():
    probs = target_probs(target_logits(), SamplingParams(temperature=1.0, top_p=0.95))
    first = int(probs[0].argmax())
    counts = emitted_counts(probs, [first, 5], None, 1, given_first=first)
    assert counts.sum() > DRAWS * probs[0, first] * 0.8
    assert chi_square_p_value(counts, probs[1]) > 1e-3, counts


def test_draft_distributions_take_the_general_rule():
    probs = target_probs(target_logits(), SamplingParams(temperature=1.0))
    torch.manual_seed(7)
    draft_probs = torch.softmax(torch.randn(2, VOCAB) * 2, -1)  # a draft model's own distributions
    # The proposed tokens are themselves drawn from the draft: the rule is exact in expectation
    # over that draw, so the test draws them too.
    counts = torch.zeros(VOCAB)
    for seed in range(DRAWS):
        g = torch.Generator().manual_seed(10_000 + seed)
        draft = [int(torch.multinomial(draft_probs[i], 1, generator=g)) for i in range(2)]
        tokens, _ = rejection_sample(probs, draft, draft_probs, g)
        counts[tokens[0]] += 1
    assert chi_square_p_value(counts, probs[0]) > 1e-3, counts


def test_the_chi_square_test_rejects_a_sampler_that_just_accepts():
    probs = target_probs(target_logits(), SamplingParams(temperature=0.9))

    def accept_all(probs, draft, draft_probs, generator):
        return list(draft) + [int(torch.multinomial(probs[len(draft)], 1, generator=generator))], len(draft)

    counts = emitted_counts(probs, [int(probs[0].argsort()[-2]), 1], None, 0, rule=accept_all)
    assert chi_square_p_value(counts, probs[0]) < 1e-6


def test_a_token_the_target_excludes_is_never_accepted():
    probs = target_probs(target_logits(), SamplingParams(temperature=1.0, top_k=2))
    excluded = int(probs[0].argmin())
    assert probs[0, excluded] == 0
    for seed in range(200):
        tokens, accepted = rejection_sample(probs, [excluded, 1], None, torch.Generator().manual_seed(seed))
        assert accepted == 0 and tokens[0] != excluded and probs[0, tokens[0]] > 0


def test_seeded_draws_repeat():
    probs = target_probs(target_logits(), SamplingParams(temperature=1.0))
    runs = [rejection_sample(probs, [1, 2], None, torch.Generator().manual_seed(5)) for _ in range(2)]
    assert runs[0] == runs[1]
