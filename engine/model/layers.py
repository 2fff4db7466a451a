"""Building blocks of the decoder: RMSNorm and tensor-parallel-ready linear layers.

Used by engine/model/llama.py. Linear layers follow the Megatron split so tensor parallelism
can shard them without touching the model: a ColumnParallelLinear keeps a slice of the output
features, a RowParallelLinear a slice of the input features and sums partial outputs with one
all-reduce. With `ParallelContext()` (world size 1) they are plain linear layers.
Weights are loaded through `load(name, full_tensor)`, which cuts this rank's shard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kernels import packed_linear


@dataclass(frozen=True)
class ParallelContext:
    """This shard's place in its tensor-parallel group; `group` (an engine.parallel.layout.ShardGroup)
    does the all-reduce. The default is a single, unsharded rank."""

    tp_rank: int = 0
    tp_size: int = 1
    group: object | None = None

    def shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        if self.tp_size == 1:
            return full
        if full.shape[dim] % self.tp_size:
            raise ValueError(f"dimension {full.shape[dim]} does not split into {self.tp_size} shards")
        return full.chunk(self.tp_size, dim=dim)[self.tp_rank]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            self.group.tp_all_reduce(x)
        return x


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the compute dtype, as the reference implementations do;
        # F.rms_norm is one fused op where the spelled-out formula is six.
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return self.weight * x32.to(x.dtype)

    def normed(self, x: torch.Tensor, fused: ModuleType | None = None) -> torch.Tensor:
        """self(x); with `fused` (kernels.cpu_ops) in one call in add_rms_norm_'s formula (the
        sum of squares added per lane: float rounding apart from torch's), where torch's own
        rms_norm of a decode row is several dispatched ops (~16 us for one 384-wide row)."""
        if fused is not None and x.dim() == 2 and x.is_contiguous() and x.dtype == self.weight.dtype:
            return fused.rms_norm(x, self.weight, self.eps)
        return self(x)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None, fused: ModuleType | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pre-norm block boundary: residual += x, then (norm(residual), residual). The
        first call of a stage has no residual yet: (norm(x), x). With `fused` (kernels.cpu_ops)
        both happen in one pass over x and residual, in place."""
        if residual is None:
            return self.normed(x, fused), x
        if fused is not None and x.is_contiguous() and residual.is_contiguous() and x.dim() == 2:
            fused.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self(residual), residual


# Decode steps multiply a few activation rows by every weight: up to this many rows, a
# weight-streaming kernel (kernels/cpu/skinny_linear.cpp) beats BLAS on CPU by 1.1-3.7x.
SKINNY_MAX_ROWS = 64
SkinnyLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, skinny: SkinnyLinear | None,
           gemv: packed_linear.PackedGemv | None = None) -> torch.Tensor:
    """F.linear; through oneDNN for a packed weight (`pack_weight`) or, for a single row, through
    `gemv` (the same packed bytes read by kernels/cpu/packed_gemv.cpp) where the weight has one;
    else through `skinny` for few-row 2-D inputs when the engine has one."""
    if weight.is_mkldnn:
        if gemv is not None and x.dim() == 2 and x.shape[0] <= gemv.max_rows:
            return gemv(x, bias)
        return packed_linear.apply(x, weight, bias)
    if skinny is not None and x.dim() == 2 and x.shape[0] <= SKINNY_MAX_ROWS and weight.shape[1] % 8 == 0:
        return skinny(x, weight, bias)
    return F.linear(x, weight, bias)


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b), W split along output features. `parts` lists fused sub-matrices
    (e.g. q, k, v) so each part is sharded on its own before concatenation."""

    def __init__(self, in_features: int, parts: list[int], bias: bool, ctx: ParallelContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.part_sizes = [p // ctx.tp_size for p in parts]
        out = sum(self.part_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out), requires_grad=False) if bias else None
        self.skinny: SkinnyLinear | None = None  # set by the model from its kernel backend
        self.gemv: packed_linear.PackedGemv | None = None  # set by pack_weight where it serves

    def _rows(self, part: int) -> slice:
        start = sum(self.part_sizes[:part])
        return slice(start, start + self.part_sizes[part])

    def load_weight(self, part: int, weight: torch.Tensor) -> None:
        copy_checked(loadable(self.weight)[self._rows(part)], self.ctx.shard(weight, 0), "weight")

    def load_bias(self, part: int, bias: torch.Tensor) -> None:
        if self.bias is None:
            raise ValueError("checkpoint has a bias this layer was not built with")
        copy_checked(self.bias.data[self._rows(part)], self.ctx.shard(bias, 0), "bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.skinny, self.gemv)


class RowParallelLinear(nn.Module):
    """y = x W^T (+ b), W split along input features; partial sums are all-reduced across
    ranks, and the bias is added once, after the reduction."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ctx: ParallelContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.weight = nn.Parameter(torch.empty(out_features, in_features // ctx.tp_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.skinny: SkinnyLinear | None = None  # set by the model from its kernel backend
        self.gemv: packed_linear.PackedGemv | None = None  # set by pack_weight where it serves

    def load_weight(self, weight: torch.Tensor) -> None:
        copy_checked(loadable(self.weight), self.ctx.shard(weight, 1), "weight")

    def load_bias(self, bias: torch.Tensor) -> None:
        if self.bias is None:
            raise ValueError("checkpoint has a bias this layer was not built with")
        copy_checked(self.bias.data, bias, "bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.ctx.all_reduce(linear(x, self.weight, None, self.skinny, self.gemv))
        return out if self.bias is None else out + self.bias


def pack_weight(module: nn.Module, int8: bool = False) -> bool:
    """After loading: module.weight into oneDNN's layout (kernels/packed_linear.py), which
    `linear` then multiplies by; False, leaving it as it is, where it does not pack. `int8`: the
    few-row products (the GEMV) take an int8 copy of the weight instead of the packed bf16 one
    (a draft's layers: speculative.draft_quantization), where its shape fits; more rows keep
    the packed bf16 weight."""
    plain = module.weight.data
    packed = packed_linear.pack(plain)
    if packed is None:
        return False
    module.weight = nn.Parameter(packed, requires_grad=False)
    module.gemv = packed_linear.gemv_for(packed, plain)
    if int8 and module.gemv is not None:
        module.gemv = packed_linear.quantize_int8(plain) or module.gemv
    return True


def loadable(weight: torch.Tensor) -> torch.Tensor:
    """The weight's plain storage to load a checkpoint tensor into; a packed one has none."""
    if weight.is_mkldnn:
        raise RuntimeError("cannot load a weight into a layer already packed for serving (pack after loading)")
    return weight.data


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """copy_ that refuses to broadcast: a checkpoint tensor of the wrong shape is an error."""
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint {what} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)
