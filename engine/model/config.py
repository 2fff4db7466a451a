"""Architecture description of a checkpoint, read from its Hugging Face config.json.

First thing the loader (engine/model/loader.py) does with a model directory: map the family's config
to one frozen ModelConfig that the model (engine/model/llama.py), the KV cache sizing and the
scheduler all read. An architecture we do not implement fails here, with its name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from configs.hf_eos import id_tuple, merged_eos_ids

# HF `architectures` entries served by engine/model/llama.py. All three families share the
# decoder block; they differ in qkv bias (Qwen2), sliding window (Mistral) and defaults.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its settings is not implemented."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...]  # frozen dict of the HF rope_scaling block
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool  # Llama's attention_bias puts a bias on o_proj too; Qwen2's is qkv only
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    @staticmethod
    def from_dir(path: str | Path) -> ModelConfig:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in model directory {path}")
        cfg = ModelConfig.from_hf_dict(json.loads(config_file.read_text()))
        # generate() stops on generation_config's eos ids, which chat models extend (e.g. an
        # end-of-turn token): serve the same stop set.
        return replace(cfg, eos_token_ids=merged_eos_ids(cfg.eos_token_ids, path))

    @staticmethod
    def from_hf_dict(cfg: dict[str, Any]) -> ModelConfig:
        try:
            return ModelConfig._from_hf_dict(cfg)
        except KeyError as exc:
            raise UnsupportedModelError(f"config.json lacks the required key {exc.args[0]!r}") from None

    @staticmethod
    def _from_hf_dict(cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or [cfg.get("model_type", "<missing>")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r}; pdserve serves {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // num_heads
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(f"num_attention_heads {num_heads} is not a multiple of {num_kv_heads}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {cfg['hidden_act']!r} is not implemented (only silu)")
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=true is not implemented")
        if family == "mistral" and cfg.get("sliding_window") and cfg["sliding_window"] < cfg.get(
            "max_position_embeddings", 2048
        ):
            raise UnsupportedModelError(f"sliding_window={cfg['sliding_window']} attention is not implemented")
        if family == "qwen2" and cfg.get("use_sliding_window"):
            raise UnsupportedModelError("Qwen2 use_sliding_window=true is not implemented")
        rope_params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
        rope_theta = float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
        rope_params.pop("rope_theta", None)
        return ModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=tuple(sorted(rope_params.items())),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=family != "qwen2" and bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=id_tuple(cfg.get("eos_token_id")),
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V that one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes
