"""A step's decoder layers in one compiled call, for steps of a few rows on the CPU path.

Sits inside LlamaForCausalLM.forward_stage (engine/model/llama.py): where every product of the
step takes the packed GEMV (decode steps, speculative verifies, draft steps: up to
`max_rows` rows), the loop over layers runs in kernels/cpu/decode_layers.cpp instead of Python.
It calls the same kernels in the same order as the Python loop (fused norms, packed GEMVs,
rotary, KV store, paged attention, SiLU-mul), so its output is bit-identical; what it saves is
the Python between them: ~10 calls a layer at 20-30 us each, which at batch 1 was a fifth of a
decode step (docs/benchmarks.md has the figures).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from engine.forward_batch import ForwardBatch
from engine.kv_cache import KVCache
from engine.model.layers import ColumnParallelLinear, RowParallelLinear
from engine.model.rope import RotaryEmbedding

if TYPE_CHECKING:
    from engine.model.llama import DecoderLayer, LlamaForCausalLM


@dataclass(frozen=True)
class _Products:
    """One kind of product (qkv, o, gate_up, down) across the layers, as the kernel takes it."""

    blocked: list[torch.Tensor]
    bias: list[torch.Tensor]  # an empty tensor where the layer has none
    shape: list[int]  # per layer: outputs, block_n, block_k
    max_rows: int  # the fewest rows any of these layers' packed GEMVs takes


def _products(linears: list[ColumnParallelLinear] | list[RowParallelLinear]) -> _Products | None:
    blocked: list[torch.Tensor] = []
    bias: list[torch.Tensor] = []
    shape: list[int] = []
    rows: list[int] = []
    for lin in linears:
        gemv = lin.gemv
        if gemv is None:
            return None
        blocked.append(gemv.blocked)
        bias.append(torch.empty(0) if lin.bias is None else lin.bias.data)
        shape += [gemv.out_features, gemv.block_n, gemv.block_k]
        rows.append(gemv.max_rows)
    return _Products(blocked, bias, shape, min(rows))


class FusedDecodeLayers:
    """The model's layers as kernels/cpu/decode_layers.cpp takes them; `build` returns None where
    it cannot serve (another backend, tensor parallelism, a weight without a packed GEMV)."""

    def __init__(self, model: LlamaForCausalLM, qkv: _Products, o: _Products, gate_up: _Products,
                 down: _Products) -> None:
        from kernels import cpu_ops

        self._ops = cpu_ops
        self._model = model
        self._layers = _layers(model)
        # qkv's bias goes into its product; o's is added after it (after the all-reduce, under TP),
        # as RowParallelLinear does; gate_up and down have none
        self._qkv, self._o, self._gate_up, self._down = qkv, o, gate_up, down
        self._norms = [w for layer in self._layers
                       for w in (layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data)]
        self.max_rows = min(p.max_rows for p in (qkv, o, gate_up, down))  # the fewest any GEMV takes

    @staticmethod
    def build(model: LlamaForCausalLM) -> FusedDecodeLayers | None:
        backend = model.backend
        if backend.name != "cpu" or backend.fused_ops is None or not len(model.layers):
            return None
        attn = [layer.self_attn for layer in _layers(model)]
        mlp = [layer.mlp for layer in _layers(model)]
        if any(a.qkv_proj.ctx.tp_size != 1 for a in attn):
            return None  # the all-reduces stay in Python
        qkv, o = _products([a.qkv_proj for a in attn]), _products([a.o_proj for a in attn])
        gate_up, down = _products([m.gate_up_proj for m in mlp]), _products([m.down_proj for m in mlp])
        if qkv is None or o is None or gate_up is None or down is None:
            return None
        return FusedDecodeLayers(model, qkv, o, gate_up, down)

    def serves(self, batch: ForwardBatch, hidden: torch.Tensor) -> bool:
        """Whether the Python loop would send every product of this step to the packed GEMV and
        its attention to the compiled kernel's single call, as decode_layers does."""
        backend = self._model.backend
        return (hidden.dtype == torch.bfloat16 and hidden.dim() == 2 and hidden.shape[0] <= self.max_rows
                and (hidden.dtype not in backend.sdpa_prefill_dtypes or batch.num_decode_seqs == batch.num_seqs))

    def __call__(self, hidden: torch.Tensor, residual: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache,
                 rope: RotaryEmbedding) -> torch.Tensor:
        """hidden: layer 0's normed input; residual: added into in place. Returns the last
        layer's MLP output, as the Python loop leaves `hidden` before the final residual add."""
        return self._ops.decode_layers(
            hidden, residual, *self.layer_args(kv_cache),
            batch.positions, rope.cos, rope.sin, batch.slot_mapping,
            batch.page_table, batch.query_start_loc, batch.context_lens,
        )

    def layer_args(self, kv_cache: KVCache) -> tuple:
        """decode_layers' arguments from its norms to its attention scale: the layers' weights
        and `kv_cache`'s pages (kernels/cpu/greedy_steps.cpp takes them in the same order)."""
        caches = [c for layer in self._layers for c in kv_cache.layer(layer.self_attn.layer_id)]
        attn = self._layers[0].self_attn
        q, o, gu, d = self._qkv, self._o, self._gate_up, self._down
        return (self._norms, self._layers[0].input_layernorm.eps,
                q.blocked, q.bias, q.shape, o.blocked, o.bias, o.shape, gu.blocked, gu.shape, d.blocked, d.shape,
                caches, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale)


def _layers(model: LlamaForCausalLM) -> list[DecoderLayer]:
    return cast("list[DecoderLayer]", list(model.layers))
