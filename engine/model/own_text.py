"""The target's own text for distillation: windows whose second part the target wrote, greedily.

Between the corpus (engine/model/train_corpus.py) and the distillation loop (engine/model/distill.py):
`own_text_windows` takes windows of the train split, keeps their first `prompt_len` tokens and has
the frozen target continue each one greedily to a whole window, once, before the loop;
`MixedSampler` then puts `per_batch` of those windows into every batch beside the corpus's.

Why: speculative decoding accepts a draft's guess when it equals the token the target generates,
so what counts is agreement on the target's own continuations, not on human-written text. A
weaker target parts from the corpus sooner (it loops, repeats identifiers), and on builtin:code-
small's 15-minute recipe the draft distilled on the corpus alone agreed with it on 84.5% of
held-out text positions but was accepted on only 0.67-0.68 of its guesses on the target's greedy
output (docs/benchmarks.md). Training on some of the target's own text aims at that (the
on-policy data of DistillSpec, Zhou et al. 2023), while the corpus windows keep the draft's
distributions close elsewhere (sampled decoding).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from engine.model.train_corpus import BatchSource, num_windows, window
from engine.model.train_loop import Compute, using_threads

if TYPE_CHECKING:
    from transformers import PreTrainedModel

GENERATE_BATCH = 64  # windows continued together: one forward a token for all of them


@dataclass(frozen=True)
class OwnText:
    num_windows: int  # windows the target continues, once, before the loop
    per_batch: int  # of each batch's windows, this many are the target's (cycled in a seeded order)
    prompt_len: int  # corpus tokens each such window starts with; the target writes the rest

    def __post_init__(self) -> None:
        if self.num_windows < 1 or self.per_batch < 1 or self.prompt_len < 1:
            raise ValueError(f"own text: num_windows, per_batch and prompt_len must be >= 1: {self}")


@torch.no_grad()
def greedy_continue(model: PreTrainedModel, prompts: torch.Tensor, num_new: int) -> torch.Tensor:
    """[n, p] -> [n, p + num_new]: each row continued with the model's argmax token, one step at a
    time over its KV cache (an end-of-text token is written on like any other)."""
    # transformers renamed the KV cache argument and output `past_key_values` -> `cache` within the
    # versions pyproject.toml allows; an unknown keyword would be swallowed and the cache dropped.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=prompts, use_cache=True)
    tokens = [out.logits[:, -1].argmax(-1, keepdim=True)]
    for _ in range(num_new - 1):
        out = model(input_ids=tokens[-1], use_cache=True, **{name: getattr(out, name)})
        tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat([prompts, *tokens], dim=1)


def own_text_windows(target: PreTrainedModel, stream: torch.Tensor, seq_len: int, own: OwnText, seed: int,
                     compute: Compute, progress: bool | None = None) -> torch.Tensor:
    """[own.num_windows, seq_len + 1] int64: windows of `stream` drawn by `seed`, each continued by
    the target from its first `own.prompt_len` tokens (the same on the same CPU and threads)."""
    if own.prompt_len >= seq_len + 1:
        raise ValueError(f"own text: prompt_len {own.prompt_len} leaves nothing of a {seq_len + 1}-token window "
                         "for the target to write")
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(num_windows(stream, seq_len), (own.num_windows,), generator=gen).tolist()
    prompts = torch.stack([window(stream, seq_len, i)[:own.prompt_len] for i in picks]).long()
    target.eval()
    rows = []
    with using_threads(compute.threads), compute.autocast(), tqdm(
            total=own.num_windows, desc="the target writing", unit="window",
            disable=None if progress is None else not progress) as bar:
        for start in range(0, own.num_windows, GENERATE_BATCH):
            rows.append(greedy_continue(target, prompts[start:start + GENERATE_BATCH], seq_len + 1 - own.prompt_len))
            bar.update(rows[-1].shape[0])
    return torch.cat(rows)


class MixedSampler:
    """Batches of corpus windows (from a WindowSampler) and, in the last `per_batch` rows, the
    target's own windows, each once per pass over them in an order drawn from `seed`."""

    def __init__(self, corpus: BatchSource, own: torch.Tensor, per_batch: int, seed: int) -> None:
        self.corpus, self.own, self.per_batch = corpus, own, per_batch
        self._gen = torch.Generator().manual_seed(seed)
        self._order: list[int] = []

    def next_batch(self, batch_size: int) -> torch.Tensor:
        """[batch_size, seq_len + 1] int64."""
        if not 0 < self.per_batch < batch_size:
            raise ValueError(f"own text: {self.per_batch} windows of each batch of {batch_size} would leave "
                             "no corpus window")
        rows = []
        for _ in range(self.per_batch):
            if not self._order:
                self._order = torch.randperm(self.own.shape[0], generator=self._gen).tolist()
            rows.append(self.own[self._order.pop()])
        return torch.cat([self.corpus.next_batch(batch_size - self.per_batch), torch.stack(rows)])
