"""Rotary position embeddings, including the rope_scaling variants Llama/Qwen2/Mistral configs use.

Called by the attention block of engine/model/llama.py on each step's flat `positions` tensor.
The frequency math follows the published formulas (and Hugging Face's float32 order of
operations), because a last-bit difference in cos/sin is enough to flip a greedy argmax.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from engine.model.config import UnsupportedModelError


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between
    # blended smoothly.
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(base: float, dim: int, p: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    # YaRN: interpolate low frequencies, extrapolate high ones, ramp between; cos/sin are then
    # scaled by an attention factor that grows with log(factor).
    original = p.get("original_max_position_embeddings") or max_pos
    factor = p.get("factor") or max_pos / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _inv_freq(
    rope_type: str, base: float, head_dim: int, scaling: dict[str, Any], max_positions: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] and the cos/sin scale for one rope_scaling type."""
    if rope_type == "default":
        return _default_inv_freq(base, head_dim), 1.0
    if rope_type == "linear":
        return _default_inv_freq(base, head_dim) / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(_default_inv_freq(base, head_dim), scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(base, head_dim, scaling, max_positions)
    raise UnsupportedModelError(f"rope_scaling type {rope_type!r} is not implemented")


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by absolute position."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        base: float,
        scaling: dict[str, Any],
    ) -> None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        try:
            inv_freq, attention_factor = _inv_freq(rope_type, base, head_dim, scaling, max_positions)
        except KeyError as exc:
            raise UnsupportedModelError(f"rope_scaling {rope_type!r} lacks the key {exc.args[0]!r}") from None
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos() * attention_factor  # [max_positions, head_dim], on the default device
        self.sin = emb.sin() * attention_factor

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for a step's positions, [num_tokens, 1, head_dim] each; looked up once
        per step and shared by every layer."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rotary(
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]: queries and keys side by side
) -> torch.Tensor:
    cos, sin = cos_sin
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
