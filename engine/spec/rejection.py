"""Verification of proposed tokens: pure functions from the target's logits to the tokens kept.

For one sequence the step computed its last token and k proposed tokens x_1..x_k, so the target
gives k + 1 rows of logits: row i is the distribution of the token after x_i (row 0: after the
last real token). Both rules emit between 1 and k + 1 tokens and leave the output exactly what
the target alone would produce:
  - greedy: keep the longest prefix of proposals equal to the target's argmax, then the
    target's argmax at the first mismatch (or after the last proposal: the bonus token);
  - sampling (speculative sampling, Leviathan et al. 2023; Chen et al. 2023): accept x_i with
    probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection draw from the residual
    normalise(max(p_i - q_i, 0)) and stop; after k acceptances draw the bonus from p_k. A
    deterministic proposal is q_i = one-hot(x_i): accept with p_i(x_i), else draw from p_i with
    x_i removed. The emitted tokens are then distributed as the target's samples.
p is the target's distribution after temperature, top-k and top-p, as engine/sampler.py draws.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampler import apply_top_k_top_p
from engine.sampling_params import SamplingParams


def verify_greedy(logits: torch.Tensor, draft: Sequence[int]) -> tuple[list[int], int]:
    """logits: [k + 1, vocab]. Returns the emitted tokens and how many proposals were accepted."""
    target = logits.max(dim=-1).indices.tolist()  # argmax, as engine/sampler.py takes it
    accepted = 0
    while accepted < len(draft) and draft[accepted] == target[accepted]:
        accepted += 1
    return list(draft[:accepted]) + [target[accepted]], accepted


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, vocab] logits -> [n, vocab] the probabilities the sampler draws from, row by row."""
    return torch.stack([apply_top_k_top_p(row / params.temperature, params.top_k, params.top_p).softmax(-1)
                        for row in logits])


def rejection_sample(
    probs: torch.Tensor,  # [k + 1, vocab] float32, the target's (target_probs)
    draft: Sequence[int],  # k proposed tokens
    draft_probs: torch.Tensor | None,  # [k, vocab] the proposer's distributions; None: point masses
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Returns the emitted tokens (1..k+1) and how many proposals were accepted."""
    for i, token in enumerate(draft):
        p = float(probs[i, token])
        q = 1.0 if draft_probs is None else float(draft_probs[i, token])
        # Accept when u < p / q, i.e. u * q < p (q > 0: the token was drawn from q).
        if float(torch.rand((), generator=generator)) * q < p:
            continue
        if draft_probs is None:
            residual = probs[i].clone()
            residual[token] = 0.0
        else:
            residual = (probs[i] - draft_probs[i]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p <= q everywhere means p == q: nothing is rejected in theory
            residual = probs[i]
        return list(draft[:i]) + [_draw(residual, generator)], i
    return list(draft) + [_draw(probs[len(draft)], generator)], len(draft)


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(weights, 1, generator=generator)[0])
