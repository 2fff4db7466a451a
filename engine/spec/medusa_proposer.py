"""Medusa proposals: the heads (engine/model/medusa_heads.py) read the target's hidden state of the
row that produced a sequence's last token and guess the tokens after it, tree-free.

The target's step already computes that row: its final-norm hidden state is what the logits of
the sequence's newest token came from (for a verifying step, the row of the last accepted token,
whose logits gave the bonus token). The speculator (engine/spec/speculator.py) hands it over
after every step with `keep_hidden`; `propose` then runs every speculating sequence's row
through the heads in one batch. If the last token is x_t, the row is h_{t-1}, and head i guesses
token t + 1 + i: head 0 the token after x_t, head 1 the one after that, and so on, k = min(heads,
the request's k). A sequence without a current row proposes nothing this step, and the step
gives it one: a decode worker's first step after the KV handoff (the prefill side's row stays
there), or the step after a preemption's recomputation.

Guesses are each head's argmax, deterministic like prompt lookup's, so verification treats them
as point masses (engine/spec/rejection.py): greedy output stays token-identical and sampled
output is distributed exactly as the target's. No pages: the heads keep no KV.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from configs.engine import EngineConfig
from engine.model.compute_dtype import resolve_dtype
from engine.model.llama import LlamaForCausalLM
from engine.model.medusa_heads import MedusaHeads, load_medusa_heads, resolve_heads_path
from engine.spec.proposer import NO_PROPOSAL, BaseProposer, Proposal

if TYPE_CHECKING:
    from engine.sequence import Sequence


@dataclass(frozen=True)
class KeptHidden:
    row: torch.Tensor  # [hidden], the target's final-norm hidden state
    num_tokens: int  # the sequence's length it is current for (its last token came from this row)


class MedusaProposer(BaseProposer):
    method = "medusa"
    reads_hidden = True

    def __init__(self, heads: MedusaHeads, guess_cost: float = 0.0) -> None:
        self.heads = heads
        self.guess_cost = guess_cost  # a head's (engine/spec/guess_cost.py)
        self.max_num_tokens = len(heads)
        self.hidden: dict[str, KeptHidden] = {}  # by request id

    def keep_hidden(self, seq: Sequence, row: torch.Tensor, num_tokens: int) -> None:
        self.hidden[seq.request_id] = KeptHidden(row, num_tokens)

    def propose(self, seqs: Seq[Sequence], max_num_tokens: Seq[int]) -> list[Proposal]:
        ready = []  # (index in seqs, k) of the sequences with a current row
        for i, (seq, k) in enumerate(zip(seqs, max_num_tokens)):
            kept = self.hidden.get(seq.request_id)
            if kept is not None and kept.num_tokens == seq.num_tokens and k > 0:
                ready.append((i, min(k, len(self.heads))))
        proposals = [NO_PROPOSAL] * len(seqs)
        if not ready:
            return proposals
        rows = torch.stack([self.hidden[seqs[i].request_id].row for i, _ in ready])  # [n, hidden]
        guesses = self.heads.top1(rows, max(k for _, k in ready)).tolist()  # [n, max k]
        for (i, k), tokens in zip(ready, guesses):
            proposals[i] = Proposal(tuple(tokens[:k]))
        return proposals

    def release(self, seq: Sequence) -> None:
        self.hidden.pop(seq.request_id, None)


def load_configured_heads(config: EngineConfig, target: LlamaForCausalLM) -> MedusaHeads:
    """`config.speculative.medusa_heads`, checked against the target, on the engine's device and
    dtype, multiplied the way the target's own linears are (its kernel backend)."""
    name = config.speculative.medusa_heads
    if name is None:
        raise ValueError("no speculative.medusa_heads configured")
    path = resolve_heads_path(name, config.cache_dir)
    cfg = target.cfg
    heads = load_medusa_heads(path, cfg.hidden_size, cfg.vocab_size, resolve_dtype(config.dtype, config.device),
                              config.device)
    # The target's projection as loaded (a tied embedding, or an lm_head not packed for oneDNN):
    # heads trained with it frozen are multiplied by the target's own, in one product.
    output = target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
    heads.prepare_for_serving(target.backend, None if output.is_mkldnn else output, target.compute_logits)
    return heads
