"""The model the trainers fit: a Hugging Face `LlamaForCausalLM` of a given shape, seeded.

Between the corpus (engine/model/train_corpus.py) and the loops (engine/model/train.py,
engine/model/distill.py): `ModelShape` (engine/model/hf_files.py) -> config.json -> the
transformers model, initialised from a seed -> trained -> `checkpoint_tensors`, the state dict
written as model.safetensors. Training in transformers' own Llama means the saved checkpoint
is, by construction, what transformers (the engine's correctness oracle) and
engine/model/loader.py read back.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.model.hf_files import ModelShape

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedModel

INIT_STD = 0.02


def build_model(shape: ModelShape, seed: int) -> LlamaForCausalLM:
    """A fresh model: weights ~ N(0, 0.02) drawn from `seed` (the residual-stream outputs,
    o_proj and down_proj, scaled down by sqrt(2 * layers) so the stream's variance does not
    grow with depth), norms at 1. Depends on nothing but the shape and the seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_dict(shape.hf_config(), attn_implementation="sdpa")
    # transformers initialises from the global generator; keep the caller's stream untouched,
    # every value is overwritten below.
    with torch.random.fork_rng():
        model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    residual_std = INIT_STD / math.sqrt(2 * shape.num_layers)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):  # the tied lm_head is the embedding
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else INIT_STD
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    return model.float().train()


def load_hf_model(path: Path) -> PreTrainedModel:
    """A checkpoint written by `checkpoint_tensors` (or any Llama-family directory) as transformers
    loads it, in float32: a distillation target."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa").eval()


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as the built-ins store it: float32, without the tied lm_head copy."""
    return {name: t.detach().float().contiguous().clone()
            for name, t in model.state_dict().items() if name != "lm_head.weight"}


def weights_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the weights in name order: equal digests, equal weights, bit for bit."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].numpy().tobytes())
    return h.hexdigest()
