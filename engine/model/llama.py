"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

The model runner (engine/model_runner.py) calls `forward(batch, kv_cache)` once per step with a
packed ForwardBatch; each layer writes its K/V into the cache and attends through
engine/model/attention.py. `load_weights` takes Hugging Face tensor names, so any checkpoint of these
families loads without conversion. Grouped-query attention, RoPE (with scaling variants),
RMSNorm, SwiGLU, tied or untied embeddings and Qwen2's qkv bias are all here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.forward_batch import ForwardBatch
from engine.kv_cache import KVCache
from engine.model.attention import AttentionBackend, paged_attention
from engine.model.config import ModelConfig
from engine.model.fused_decode import FusedDecodeLayers
from engine.model.layers import (
    ColumnParallelLinear,
    ParallelContext,
    RMSNorm,
    RowParallelLinear,
    copy_checked,
    linear,
    pack_weight,
)
from engine.model.rope import RotaryEmbedding, apply_rotary
from kernels import packed_linear


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_heads // ctx.tp_size
        self.num_kv_heads = cfg.num_kv_heads // ctx.tp_size  # ShardLayout.check_model: it divides
        self.scale = cfg.head_dim**-0.5
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q_size, kv_size, kv_size], cfg.qkv_bias, ctx)
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, cfg.o_bias, ctx)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache,
        rotate: Callable[[torch.Tensor, int], torch.Tensor], backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        h, kv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(num_tokens, h + 2 * kv, self.head_dim)
        # Queries and keys take the same rotation: one call for both halves the op count.
        qk = rotate(qkv, h + kv)
        q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + kv :]
        k_cache, v_cache = kv_cache.layer(self.layer_id)
        out = paged_attention(backend, batch, q, k, v, k_cache, v_cache, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size, cfg.intermediate_size], False, ctx
        )
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, ctx)

    def forward(self, x: torch.Tensor, fused: ModuleType | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if fused is not None and gate_up.dim() == 2:
            return self.down_proj(fused.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, ctx, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, ctx)


class LlamaForCausalLM(nn.Module):
    """The whole model, or one pipeline stage of it (`layers`: the global ids this stage runs)
    with attention heads and MLP sharded by `ctx`. Embedding, final norm and vocabulary
    projection are kept whole on every shard: the first stage embeds, the driver samples."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, ctx: ParallelContext | None = None,
                 layers: range | None = None) -> None:
        super().__init__()
        ctx = ctx or ParallelContext()
        self.cfg = cfg
        self.backend = backend
        self.layer_ids = layers if layers is not None else range(cfg.num_layers)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ctx, i) for i in self.layer_ids)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Tied checkpoints reuse the embedding as the output projection.
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if self.lm_head is not None:
            self.lm_head.weight.requires_grad_(False)
        # Built on the default device, which the loader sets to the engine's device.
        self.rope = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling_dict
        )
        for module in self.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.skinny = backend.skinny_linear
        self.packed_output: torch.Tensor | None = None  # set by pack_weights for a tied output projection
        self.output_gemv: packed_linear.PackedGemv | None = None  # its single-row path, where it has one
        # the layers in one compiled call for steps of a few rows, where pack_weights finds it serves
        self.fused_decode: FusedDecodeLayers | None = None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Runs one step; returns the final hidden states of the rows in `batch.logits_indices`."""
        return self.final_norm(self.forward_stage(batch, kv_cache), batch)

    @torch.inference_mode()
    def forward_stage(self, batch: ForwardBatch, kv_cache: KVCache, hidden: torch.Tensor | None = None
                      ) -> torch.Tensor:  # [num_tokens, hidden]
        """This stage's layers over the step: from the token embeddings (first stage) or from
        the previous stage's `hidden`."""
        if hidden is None:
            hidden = self.embed_tokens(batch.input_ids)
        else:
            hidden = hidden.clone()  # the fused norms add into the residual in place: not the caller's buffer
        fused = self.backend.fused_ops
        if self.fused_decode is not None and self.fused_decode.serves(batch, hidden):
            hidden, residual = self.layers[0].input_layernorm.add_norm(hidden, None, fused)
            return self.fused_decode(hidden, residual, batch, kv_cache, self.rope) + residual
        rotate = self._rotation(batch, hidden.dtype, fused)
        residual = None
        for layer in self.layers:
            hidden, residual = layer.input_layernorm.add_norm(hidden, residual, fused)
            hidden = layer.self_attn(hidden, batch, kv_cache, rotate, self.backend)
            hidden, residual = layer.post_attention_layernorm.add_norm(hidden, residual, fused)
            hidden = layer.mlp(hidden, fused)
        return hidden + residual

    def _rotation(self, batch: ForwardBatch, dtype: torch.dtype, fused: ModuleType | None
                  ) -> Callable[[torch.Tensor, int], torch.Tensor]:
        """rotate(qkv, n): the first n heads of qkv [T, heads, d] rotated by position, for every
        layer of this step: in place by one fused call, or from cos/sin rows looked up once."""
        if fused is not None:
            def rotate_in_place(qkv: torch.Tensor, n: int) -> torch.Tensor:
                fused.rotary_(qkv, batch.positions, self.rope.cos, self.rope.sin, n)
                return qkv[:, :n]
            return rotate_in_place
        cos_sin = self.rope.lookup(batch.positions, dtype)
        return lambda qkv, n: apply_rotary(cos_sin, qkv[:, :n])

    @torch.inference_mode()
    def final_norm(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # Only the rows that will be sampled need the final norm and the vocabulary projection:
        # for a 1,000-token prefill chunk that is one row, not a thousand.
        return self.norm.normed(hidden[batch.logits_indices], self.backend.fused_ops)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_sampled, vocab]
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        gemv = getattr(self.lm_head, "gemv", None) if self.lm_head is not None else self.output_gemv
        if self.packed_output is not None:
            weight = self.packed_output
        return linear(hidden, weight, None, self.backend.skinny_linear, gemv).float()

    def pack_weights(self, int8_layers: bool = False) -> None:
        """After loading, where the backend multiplies by packed weights (kernels/packed_linear.py):
        every linear layer's weight into oneDNN's layout, and the vocabulary projection, which
        is a packed copy when it is tied to the embedding (the lookup still needs the plain one).
        `int8_layers`: the decoder layers' few-row products read int8 copies (pack_weight)."""
        if not self.backend.packs_linears:
            return
        for module in self.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                pack_weight(module, int8_layers)
        if self.lm_head is not None:
            pack_weight(self.lm_head)
        else:
            self.packed_output = packed_linear.pack(self.embed_tokens.weight.data)
            self.output_gemv = packed_linear.gemv_for(self.packed_output, self.embed_tokens.weight.data)
        self.fused_decode = FusedDecodeLayers.build(self)

    def gemv_buffers(self) -> list[torch.Tensor]:
        """The int8 weight copies the few-row products read (pack_weights' int8_layers), which
        are not parameters."""
        return [m.gemv.blocked for m in self.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
                and m.gemv is not None and m.gemv.blocked.dtype == torch.uint8]

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads HF-named tensors; fails naming any tensor the model has no place for, lacks,
        or has in another shape."""
        params = dict(self.named_parameters())
        seen: set[str] = set()
        for name, tensor in tensors:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue  # recomputed / tied: some checkpoints still store them
            parts = name.split(".")  # layers.<i>.<block>.<proj>.<weight|bias>
            if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit():
                layer_id = int(parts[1])
                if layer_id >= self.cfg.num_layers:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {self.cfg.num_layers} layers")
                if layer_id not in self.layer_ids:
                    continue  # another pipeline stage's layer
                parts[1] = str(self.layer_ids.index(layer_id))  # this stage's local numbering
                name = ".".join(parts)
            if len(parts) == 5 and parts[0] == "layers" and parts[4] in ("weight", "bias"):
                layer, proj, kind = self.layers[int(parts[1])], parts[3], parts[4]
                if proj in _FUSED:
                    fused_name, part = _FUSED[proj]
                    module = layer.get_submodule(fused_name)
                    (module.load_weight if kind == "weight" else module.load_bias)(part, tensor)
                    seen.add(f"layers.{parts[1]}.{fused_name}.{kind}")
                    continue
                if proj in ("o_proj", "down_proj"):
                    module = layer.get_submodule(f"{parts[2]}.{proj}")
                    (module.load_weight if kind == "weight" else module.load_bias)(tensor)
                    seen.add(name)
                    continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {self.cfg.architecture}")
            copy_checked(params[name].data, tensor, name)
            seen.add(name)
        missing = set(params) - seen
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


# HF projections that this model stores fused: name -> (fused module, part index).
_FUSED = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
}
