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

import ctypes

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


# Up to how many rows `PackedGemv` (kernels/cpu/packed_gemv.cpp) multiplies instead of oneDNN,
# by layout. AMX (32 x 32 tiles): on AMX tiles, 1-32 rows (`packed_gemv_amx_supported`);
# builtin:small's 12 layers of weights, 2 Sapphire Rapids-class cores, the same run: 5.1-6.0 vs
# oneDNN's 8.0-8.4 ms at 1-8 rows, 6.7 vs 8.7 at 16, 8.4 vs 10.2 at 32 (`AMX_GEMM_ROWS`). With
# VDPBF16PS alone it served 1 row (4.7 vs 5.5 ms; slower than oneDNN from 2 rows), which is
# what a build without AMX tiles keeps. AVX512-BF16 without AMX (blocks of 64 outputs): faster
# than oneDNN at every row count it serves, 2.85 vs 3.58 ms at 1 row, 3.0 vs 4.8 at 2, 3.2 vs
# 4.2 at 4, 4.0 vs 5.0 at 8 (the same 12 layers, Zen 5); from 9 to 64 rows in groups of 6
# (run_tiled): the 12 layers and the vocabulary projection 4.5 vs 5.7 ms at 9 rows, 4.9-5.0 vs
# 6.7-6.9 at 16, 7.9-8.0 vs 10.0-10.7 at 32, 10.8 vs 13.2 at 48, 15.2-15.9 vs 16.6-17.2 at 64
# (another Zen 5, weights streamed from memory), so decode steps of up to 64 sequences run
# their layers in one call.
GEMV_MAX_ROWS = {32: 1, 64: 64}  # block_n -> rows, without AMX tiles
AMX_GEMM_ROWS = 32  # rows of the 32 x 32 layout multiplied on AMX tiles
# Past 32 rows (prefill chunks), the same AMX kernel takes weights with no more outputs than
# inputs (builtin:small's o and down projections) up to AMX_PREFILL_ROWS rows. oneDNN ran the
# 768 x 2,048 down projection at 0.74-0.95 TFLOP/s from 64 to 1,280 rows (1.70 ms at 512 rows,
# 3.60 at 1,024) where the tile kernel runs 1.19-1.73 (0.96 and 1.87 ms), and the 768 x 768 o
# projection at ~0.95 at 512 and 1,024 rows against 1.49-1.56 (oneDNN was faster at 1,280
# rows: 2.07 against 1.57; the two layers together still 5.0 against 3.3 ms). From 1,536 rows
# oneDNN is as fast or faster; wider weights (qkv, gate_up) stay with oneDNN, which runs them
# at 1.0-2.2 TFLOP/s. The results differ only in the order fp32 partial sums are added. 2 Sapphire
# Rapids-class cores, torch 2.13's oneDNN: `python benchmarks/gemm_shapes.py --rows
# 64,256,512,1024,1280,1536,2048 --dtypes bfloat16 --by-shape` (the `packed` and `engine` columns).
AMX_PREFILL_ROWS = 1280
PROBE_ROWS = 3  # the layout probe multiplies a few rows whatever the threshold


class PackedGemv:
    """A packed bf16 weight read in place, for the few-row products of decode steps, by
    kernels/cpu/packed_gemv.cpp: `blocked` is a flat bf16 view of the packed tensor's own bytes
    (no copy; `packed` is held so they stay alive), in blocks of `block_n` outputs by tiles of
    `block_k` inputs. Or an int8 copy (`quantize_int8`): `blocked` a uint8 buffer of its own,
    `packed` None."""

    def __init__(self, packed: torch.Tensor | None, blocked: torch.Tensor, out_features: int, block_n: int = 32,
                 block_k: int = 32) -> None:
        self.packed, self.blocked, self.out_features = packed, blocked, out_features
        self.block_n, self.block_k = block_n, block_k
        # engine/model/layers.py `linear` asks it for no more
        self.max_rows = max_rows(block_n, block_k, out_features, blocked.numel() // out_features)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from kernels import cpu_ops

        return cpu_ops.packed_gemv(x, self.blocked, self.out_features, bias, self.block_n, self.block_k)


def max_rows(block_n: int, block_k: int, out_features: int = 0, in_features: int = 0) -> int:
    """The most activation rows the packed kernel takes over oneDNN for this layout (and, on AMX
    tiles, this weight shape: `AMX_PREFILL_ROWS`) here."""
    from kernels import cpu_ops

    if (block_n, block_k) == (32, 32) and cpu_ops.packed_gemv_amx_supported():
        return AMX_PREFILL_ROWS if 0 < out_features <= in_features else AMX_GEMM_ROWS
    return GEMV_MAX_ROWS[block_n]


def layouts(k: int) -> tuple[tuple[int, int], ...]:
    """The (block_n, block_k) layouts oneDNN packs bf16 weights [N, k] in: 32 x 32 tiles on AMX
    CPUs (`AB16b32a2b`), blocks of 64 outputs over the whole of K with AVX512-BF16 alone."""
    return ((32, 32), (64, k))


def gemv_for(packed: torch.Tensor | None, weight: torch.Tensor) -> PackedGemv | None:
    """A PackedGemv over `packed` (= pack(weight)) where the CPU kernel serves it: bf16, K a
    multiple of 32, AVX512-BF16, and oneDNN's layout one the kernel reads (`layouts`), which a
    probe product against F.linear on the plain weight picks. None elsewhere."""
    from kernels import cpu_ops

    if packed is None or weight.dtype != torch.bfloat16 or weight.dim() != 2 or cpu_ops.load() is None:
        return None
    n, k = weight.shape
    nbytes = torch.ops.mkldnn._nbytes(packed)
    if k % 32 or nbytes != n * k * 2 or not cpu_ops.packed_gemv_supported():
        return None
    buffer = (ctypes.c_char * nbytes).from_address(torch.ops.mkldnn.data_ptr(packed))
    blocked = torch.frombuffer(buffer, dtype=torch.bfloat16)
    probe = torch.randn(PROBE_ROWS, k, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    want = torch.nn.functional.linear(probe, weight).float()
    for block_n, block_k in layouts(k):
        if n % block_n:
            continue
        gemv = PackedGemv(packed, blocked, n, block_n, block_k)
        if torch.allclose(gemv(probe, None).float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max())):
            return gemv
    return None


INT8_BLOCK_N, INT8_BLOCK_K = 64, 4  # kernels/cpu/packed_gemv.cpp run_int8's layout


def int8_supported() -> bool:
    """Whether `quantize_int8`'s weights can be multiplied here."""
    from kernels import cpu_ops

    return cpu_ops.load() is not None and cpu_ops.packed_gemv_supported() and cpu_ops.int8_gemv_supported()


def quantize_int8(weight: torch.Tensor) -> PackedGemv | None:
    """weight [N, K] as kernels/cpu/packed_gemv.cpp's int8 buffer: symmetric int8 with one scale
    per output (max |w| / 127), laid out [N / 64][K / 4][64][4], then the N fp32 scales and the N
    int32 sums of each output's int8 weights; a PackedGemv over it (packed_gemv takes a uint8
    buffer as int8). None where the shape does not fit the blocks (N a multiple of 64, K of 4)."""
    n, k = weight.shape
    if n % INT8_BLOCK_N or k % INT8_BLOCK_K:
        return None
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)  # [N, K]
    blocked = q.reshape(n // INT8_BLOCK_N, INT8_BLOCK_N, k // INT8_BLOCK_K, INT8_BLOCK_K).permute(0, 2, 1, 3)
    buffer = torch.cat([blocked.contiguous().view(torch.uint8).flatten(),
                        scale.to(torch.float32).contiguous().view(torch.uint8),
                        q.sum(dim=1, dtype=torch.int32).contiguous().view(torch.uint8)])
    return PackedGemv(None, buffer, n, INT8_BLOCK_N, INT8_BLOCK_K)


def dequantized_int8(gemv: PackedGemv) -> torch.Tensor:
    """The float32 weight [N, K] that `quantize_int8`'s buffer stands for (tests' reference)."""
    n = gemv.out_features
    k = (gemv.blocked.numel() - 8 * n) // n
    q = gemv.blocked[: n * k].view(torch.int8).reshape(n // INT8_BLOCK_N, k // INT8_BLOCK_K, INT8_BLOCK_N,
                                                          INT8_BLOCK_K).permute(0, 2, 1, 3).reshape(n, k)
    scale = gemv.blocked[n * k : n * k + 4 * n].view(torch.float32)
    return q.float() * scale[:, None]
