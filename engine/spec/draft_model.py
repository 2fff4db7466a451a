"""A draft model for speculative decoding: its weights, its own paged KV cache and page manager,
and a model runner, loaded beside the target by the engine (engine/engine.py) when
`speculative.draft_model` is set; engine/spec/draft_proposer.py drives it.

The draft is any Hugging Face checkpoint the loader serves whose vocabulary is the target's
(token ids must mean the same tokens on both sides). It runs in the engine's process, on the
engine's device and dtype, with the same attention backends: a draft step is an ordinary
ForwardBatch over the draft's own pages. It gets as many pages as the target (of its own
geometry): a sequence never holds more draft positions than target ones, so the draft runs out
of pages only where prefix sharing lets the target hold fewer pages than its sequences use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from configs.engine import EngineConfig
from engine.kv_cache import KVCache
from engine.model.compute_dtype import resolve_dtype
from engine.model.config import ModelConfig
from engine.model.layers import linear
from engine.model.loader import load_model, resolve_model_path
from engine.model_runner import ModelRunner
from engine.page_manager import PageManager
from engine.parallel.model_shard import attention_backend
from engine.parallel.shard_executor import LocalExecutor
from engine.spec.fused_draft import FusedDraftSteps
from engine.spec.guess_cost import draft_guess_cost
from kernels import packed_linear


@dataclass
class DraftModel:
    config: ModelConfig
    runner: ModelRunner
    kv_cache: KVCache
    page_manager: PageManager  # the draft's pages only; no prefix cache (drafts recompute)
    # [vocab_limit, hidden]: the output projection's first rows (speculative.draft_vocab_size),
    # a contiguous copy so the projection reads only them; None: the model's own projection.
    head: torch.Tensor | None = None
    guess_cost: float = 0.0  # a guess over a target step (engine/spec/guess_cost.py)

    @property
    def max_model_len(self) -> int:
        return self.config.max_position_embeddings

    def fused_steps(self) -> FusedDraftSteps | None:
        """The compiled loop for greedy follow-up steps, where it serves this draft."""
        return FusedDraftSteps.build(self)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> [rows, vocab] float32 on CPU; past `head`'s rows, -inf (never guessed)."""
        if self.head is None or not hidden.shape[0]:
            return self.runner.logits(hidden)
        model = self.runner.model
        scored = linear(hidden, self.head, None, model.backend.skinny_linear, None).float().cpu()  # [rows, limit]
        out = torch.full((hidden.shape[0], self.config.vocab_size), float("-inf"))
        out[:, : self.head.shape[0]] = scored
        return out


def load_draft_model(config: EngineConfig, target: ModelConfig, num_pages: int) -> DraftModel:
    """Loads `config.speculative.draft_model` for a target of config `target` whose KV cache has
    `num_pages` pages. Raises ValueError when the draft cannot serve this target."""
    name = config.speculative.draft_model
    if name is None:
        raise ValueError("no speculative.draft_model configured")
    path = resolve_model_path(name, config.cache_dir)
    cfg = ModelConfig.from_dir(path)
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"speculative.draft_model {name!r} has vocab_size {cfg.vocab_size}, the target "
                         f"{target.vocab_size}: a draft must use the target's tokenizer")
    dtype = resolve_dtype(config.dtype, config.device)
    int8 = config.speculative.draft_quantization == "int8"
    if int8 and (dtype != torch.bfloat16 or config.device != "cpu" or not packed_linear.int8_supported()):
        raise ValueError("speculative.draft_quantization int8 needs a bf16 draft on a CPU with AVX512-VNNI and "
                         f"AVX512-BF16 (here: dtype {dtype}, device {config.device}, int8 kernel "
                         f"{'available' if packed_linear.int8_supported() else 'unavailable'})")
    model = load_model(path, dtype, config.device, attention_backend(config, cfg.head_dim), int8_layers=int8)
    kv_cache = KVCache(cfg, num_pages, config.page_size, dtype, config.device)
    runner = ModelRunner(model, LocalExecutor(model, kv_cache), config.page_size, config.device)
    limit = config.speculative.draft_vocab_size
    head = None
    if limit is not None and limit < cfg.vocab_size:
        weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        head = weight[:limit].contiguous()
    return DraftModel(cfg, runner, kv_cache, PageManager(num_pages, config.page_size, enable_prefix_caching=False),
                      head, draft_guess_cost(cfg, target, limit, int8))
