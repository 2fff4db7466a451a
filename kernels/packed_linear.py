"""x W^T (+ b) on CPU with the weight packed once, at load, into oneDNN's blocked layout.

Where the CPU serving path's linear layers go (engine/model/layers.py `linear`, chosen by the `cpu`
backend of engine/model/attention.py). A plain F.linear hands a row-major weight to BLAS, which
re-packs it into cache-sized panels on every call; a weight packed once skips that. Measured
side by side on the builtin:small layer shapes (2-core Zen 4, `python benchmarks/gemm_shapes.py`):
1.8-3x F.linear at 16-64 rows (decode batches) in float32, 1.2-1.7x in bfloat16, 1.15x at 512
rows (prefill chunks), and 2x the weight-streaming skinny kernel from 16 rows up. This is what
vLLM's CPU backend gets from its own oneDNN build; here it is PyTorch's bundled oneDNN, so no
extra install.

`pack` returns None where this torch has no oneDNN or oneDNN refuses the dtype; callers then
keep the plain weight and F.linear.
"""

from __future__ import annotations

import torch

# oneDNN's CPU kernels: float32 everywhere, bfloat16 through AVX512-BF16/AMX (emulated, and
# slower than float32, on older CPUs, where dtype `auto` already picks float32).
PACKED_DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The [out, in] weight in oneDNN's layout (an opaque `torch._mkldnn` tensor of the same
    shape), or None where it cannot be packed. Checked once against F.linear on a few rows."""
    if not available() or weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES or weight.dim() != 2:
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
        probe = torch.ones(2, weight.shape[1], dtype=weight.dtype)
        ok = torch.allclose(apply(probe, packed, None).float(), torch.nn.functional.linear(probe, weight).float(),
                            rtol=1e-2, atol=1e-2 * weight.abs().max().item() * weight.shape[1] ** 0.5)
    except RuntimeError:
        return None
    return packed if ok else None


def apply(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ packed^T (+ bias) -> [..., out]; any number of rows, strided x allowed."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
