"""The peak memory bandwidth and compute a worker's MBU and MFU are measured against.

Configured per pool (`peak_memory_bandwidth_gbps`, `peak_tflops` in the cluster YAML) for the
datasheet figures; otherwise `measure_peak` takes a rough reading at worker start-up, in well
under a second: the best of a few timed copies of a 64 MiB buffer (bytes read + written per
second) and the best of a few square matmuls in the engine's dtype. A measured peak is what
this process reached at that moment on a possibly shared machine, so it understates a
datasheet peak and MBU/MFU against it read high; configure the peak for numbers to compare.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.model.compute_dtype import resolve_dtype


@dataclass(frozen=True)
class Peak:
    memory_bytes_per_s: float
    flops_per_s: float
    source: str  # "configured" or "measured"

    @staticmethod
    def configured(memory_bandwidth_gbps: float, tflops: float) -> Peak:
        return Peak(memory_bandwidth_gbps * 1e9, tflops * 1e12, "configured")


def _best_time_s(fn, repeats: int, device: torch.device) -> float:
    fn()  # warm-up: page faults, kernel selection
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


@torch.inference_mode()
def measure_peak(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 copy_bytes: int = 64 << 20, matmul_size: int = 1024, repeats: int = 3) -> Peak:
    """Rough peaks from a timed copy and a timed matmul (see the module docstring)."""
    device = torch.device(device)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    copy_s = _best_time_s(lambda: dst.copy_(src), repeats, device)
    a = torch.randn(matmul_size, matmul_size, device=device).to(dtype)
    b = torch.randn(matmul_size, matmul_size, device=device).to(dtype)
    matmul_s = _best_time_s(lambda: a @ b, repeats, device)
    return Peak(memory_bytes_per_s=2 * copy_bytes / copy_s, flops_per_s=2 * matmul_size**3 / matmul_s,
                source="measured")


@torch.inference_mode()
def measure_read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of the best of `repeats` streaming reads (a sum, every thread) of a CPU buffer of
    `num_bytes`, far larger than the caches by default: the floor the benchmarks hold
    memory-bound steps to (benchmarks/vs_vllm.py, engine_steps.py, decode_attention.py)."""
    buf = torch.ones(num_bytes // 4, dtype=torch.float32)
    return buf.numel() * 4 / _best_time_s(buf.sum, repeats, buf.device)


def resolve_peak(memory_bandwidth_gbps: float | None, tflops: float | None, device: str, dtype_name: str) -> Peak:
    """The configured peaks; whichever is not configured is measured (`source` says which)."""
    if memory_bandwidth_gbps is not None and tflops is not None:
        return Peak.configured(memory_bandwidth_gbps, tflops)
    measured = measure_peak(device, resolve_dtype(dtype_name, device))
    if memory_bandwidth_gbps is None and tflops is None:
        return measured
    return Peak(memory_bandwidth_gbps * 1e9 if memory_bandwidth_gbps is not None else measured.memory_bytes_per_s,
                tflops * 1e12 if tflops is not None else measured.flops_per_s, "configured+measured")
