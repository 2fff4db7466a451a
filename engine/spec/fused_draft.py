"""A draft model's greedy proposal in one compiled call, on the CPU path.

engine/spec/draft_proposer.py computes each twin's catch-up (the tokens it has no KV for) and
then feeds each guess back for k - 1 one-token steps. Where every twin is greedy, its catch-up
short and the draft's layers run in one call (engine/model/fused_decode.py), all of those steps
go to kernels/cpu/greedy_steps.cpp at once (or the follow-ups alone, after a long catch-up): per step
the embedding, the layers, the final norm, the output projection and the argmax, with the same
kernels in the same order as LlamaForCausalLM.forward and DraftModel.logits, so the guesses and
the KV written for them are the Python loop's. Why: a draft pays for itself only if its step
costs a small fraction of a target step, and a small draft's step was mostly Python (building
the batch, module calls, the argmax's trip back) around well under a millisecond of kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.model.layers import SKINNY_MAX_ROWS

if TYPE_CHECKING:
    from engine.spec.draft_model import DraftModel


class FusedDraftSteps:
    """`build` returns None where the compiled loop cannot serve the draft (no fused layers, an
    output projection without a packed GEMV, a head the skinny kernel does not take)."""

    def __init__(self, draft: DraftModel, head: tuple[torch.Tensor, int, int, int], max_rows: int) -> None:
        from kernels import cpu_ops

        model = draft.runner.model
        assert model.fused_decode is not None  # build checked it
        self._ops = cpu_ops
        self._model = model
        self._layer_args = model.fused_decode.layer_args(draft.kv_cache)
        self._first_norm = self._layer_args[0][0]  # the norms, layer by layer: layer 0's input norm first
        self._head = head  # the projection, its outputs, block_n, block_k (0, 0: a plain weight)
        self.page_size = draft.runner.page_size
        self.max_rows = max_rows

    @staticmethod
    def build(draft: DraftModel) -> FusedDraftSteps | None:
        model = draft.runner.model
        fused = model.fused_decode
        if fused is None or model.embed_tokens.weight.dtype != torch.bfloat16 or not len(model.layers):
            return None
        if draft.head is not None:  # speculative.draft_vocab_size: DraftModel.logits takes the skinny kernel
            if model.backend.skinny_linear is None or draft.head.shape[1] % 8:
                return None
            return FusedDraftSteps(draft, (draft.head, draft.head.shape[0], 0, 0), min(fused.max_rows, SKINNY_MAX_ROWS))
        gemv = model.output_gemv if model.lm_head is None else getattr(model.lm_head, "gemv", None)
        if gemv is None:
            return None
        return FusedDraftSteps(draft, (gemv.blocked, gemv.out_features, gemv.block_n, gemv.block_k),
                               min(fused.max_rows, gemv.max_rows))

    def serves(self, num_rows: int) -> bool:
        return 0 < num_rows <= self.max_rows

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, num_fed: torch.Tensor,
                 page_table: torch.Tensor, num_steps: torch.Tensor) -> torch.Tensor:
        """input_ids [sum(num_fed)] int64: the tokens each row feeds first (its catch-up), row after
        row; positions [rows] int64: the first one's; num_fed [rows] int64 >= 1; page_table [rows,
        max_pages] int32, holding every step's slot; num_steps [rows] int64 >= 1: guesses.
        Returns the guesses [max(num_steps), rows] int64 (-1 past a row's last step)."""
        model = self._model
        return self._ops.greedy_steps(
            input_ids, positions, num_fed, page_table, num_steps, self.page_size,
            model.embed_tokens.weight.data, self._first_norm, model.norm.weight.data,
            *self._layer_args, model.rope.cos, model.rope.sin, *self._head,
        )
