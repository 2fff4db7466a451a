"""The Hugging Face files every built-in checkpoint is made of, written byte-for-byte reproducibly.

Last stop of every built-in build: engine/model/builtin.py (random `builtin:tiny` / `builtin:small`)
and engine/model/trained_builtins.py (trained `builtin:code-small` / `builtin:code-draft`) write
their tokenizer, config.json, generation_config.json and safetensors weights through here, so
transformers and engine/model/loader.py read the same directory. JSON is written with sorted
keys and the tokenizer trainer is deterministic: the same inputs give the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]  # ids 0, 1, 2: bos, eos, pad
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2


def write_bpe_tokenizer(out: Path, vocab_size: int, model_max_length: int, lines: Iterable[str]) -> None:
    """A byte-level BPE tokenizer of `vocab_size` trained on `lines`; every encoding starts with <s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(lines, trainer=trainer)
    # Llama-style: every encoded prompt starts with <s>.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": True,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}, indent=2) + "\n"
    )


def copy_tokenizer(src: Path, out: Path) -> None:
    """The tokenizer files of checkpoint `src` into `out` (a draft shares its target's tokenizer):
    tokenizer.json, and the two optional ones where `src` has them."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if name == "tokenizer.json" or (src / name).is_file():
            (out / name).write_bytes((src / name).read_bytes())


@dataclass(frozen=True)
class ModelShape:
    """The numbers that make a Llama-family checkpoint's config.json (engine/model/builtin.py's
    random built-ins and engine/model/train_model.py's trained ones)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int

    def hf_config(self) -> dict:
        """config.json: a Llama with tied embeddings and the built-ins' special-token ids."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": True,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "pad_token_id": PAD_ID,
            "torch_dtype": "float32",
        }

    @classmethod
    def of(cls, model: LlamaForCausalLM) -> ModelShape:
        cfg = model.config
        return cls(cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                   cfg.num_key_value_heads or cfg.num_attention_heads, cfg.intermediate_size,
                   cfg.max_position_embeddings)

    def num_parameters(self) -> int:
        """Weights, counting the tied embedding once."""
        head_dim = self.hidden_size // self.num_heads
        attn = self.hidden_size * head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attn + mlp + 2 * self.hidden_size
        return self.vocab_size * self.hidden_size + self.num_layers * per_layer + self.hidden_size


def write_checkpoint(out: Path, config: dict, tensors: dict[str, torch.Tensor], about: dict) -> None:
    """config.json, generation_config.json, model.safetensors and `about` as pdserve_builtin.json."""
    save_file({k: tensors[k].contiguous() for k in sorted(tensors)}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "do_sample": False},
                   indent=2, sort_keys=True) + "\n"
    )
    (out / "pdserve_builtin.json").write_text(json.dumps(about, indent=2) + "\n")
