"""Bytes and FLOPs a step moves and computes, from the model's shape: the numerators of decode
MBU and prefill MFU (docs/design.md §6).

engine/metrics/worker_metrics.py turns each step's `StepWork` (engine/metrics/step_stats.py) into
    decode bytes  = weight bytes + KV bytes read (every decoding sequence's context),
    prefill FLOPs = 2 * matmul params * prefill tokens + attention FLOPs (QK^T and AV over each
                    token's causal context) + 2 * lm_head params per sampled row,
and divides by the step time and the peak (engine/metrics/peak.py). Weight bytes are what this process
holds (a tensor-parallel shard holds its share), counted from the loaded parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.metrics.step_stats import StepWork
from engine.model.config import ModelConfig


@dataclass(frozen=True)
class ModelCost:
    weight_bytes: int  # parameters resident in this process
    kv_bytes_per_token: int  # K and V, every layer
    matmul_params_per_token: int  # decoder-layer projection weights applied to every token
    lm_head_params: int  # vocab x hidden, applied to the rows that sample
    attention_flops_per_attended_token: int  # QK^T + AV, every layer, per (query, key) pair

    @staticmethod
    def of(cfg: ModelConfig, weight_bytes: int, kv_element_bytes: int) -> ModelCost:
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        per_layer = cfg.hidden_size * (q_dim + 2 * kv_dim) + q_dim * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
        return ModelCost(
            weight_bytes=weight_bytes,
            kv_bytes_per_token=cfg.kv_bytes_per_token(kv_element_bytes),
            matmul_params_per_token=cfg.num_layers * per_layer,
            lm_head_params=cfg.vocab_size * cfg.hidden_size,
            attention_flops_per_attended_token=cfg.num_layers * 4 * q_dim,  # 2 FLOPs x (QK^T + AV)
        )

    def decode_bytes(self, work: StepWork) -> int:
        """Bytes a step's decodes must read: every weight once, plus each sequence's KV."""
        if not work.num_decode_tokens:
            return 0
        return self.weight_bytes + work.num_decode_context_tokens * self.kv_bytes_per_token

    def prefill_flops(self, work: StepWork) -> int:
        """FLOPs of a step's prefill work (the last token of each chunk feeds lm_head)."""
        if not work.num_prefill_tokens:
            return 0
        return (2 * self.matmul_params_per_token * work.num_prefill_tokens
                + self.attention_flops_per_attended_token * work.num_prefill_attended_tokens
                + 2 * self.lm_head_params * work.num_prefill_seqs)
