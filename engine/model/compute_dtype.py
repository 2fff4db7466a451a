"""Which floating-point type an engine computes and caches in, from the config and the hardware.

Read once at start-up by engine/parallel/model_shard.py (weights and KV cache) and engine/metrics/peak.py (the
peak it measures MBU/MFU against). `auto`, the default, takes bfloat16 where it is fast (a GPU,
or a CPU with native bf16 arithmetic: AVX512-BF16 or AMX) and float32 elsewhere. On a CPU with
only AVX2, bf16 is converted in software around every multiply: the engine measured a batch 4x
slower in bf16 than in fp32 there, so asking for bfloat16 on such a CPU starts with a warning.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True when /proc/cpuinfo lists a bf16 arithmetic extension (AVX512-BF16 or AMX-BF16).
    PDSERVE_CPU_NATIVE_BF16=0/1 overrides the reading (the test suite pins float32 with it, as
    its oracle is float32, on whatever processor it runs)."""
    forced = os.environ.get("PDSERVE_CPU_NATIVE_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return any(f in flags for f in _NATIVE_BF16_FLAGS)
    return False


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """The torch dtype for a config's `dtype` on `device` ('auto' resolved as above)."""
    on_gpu = not device.startswith("cpu")
    if name == "auto":
        return torch.bfloat16 if on_gpu or cpu_has_native_bf16() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of auto, {', '.join(DTYPES)}")
    if name in ("bfloat16", "float16") and not on_gpu and not cpu_has_native_bf16():
        _warn_slow_dtype(name)
    return DTYPES[name]


@functools.cache  # once per process, however many parts of the engine resolve the dtype
def _warn_slow_dtype(name: str) -> None:
    log.warning(
        "dtype %s on a CPU without native bf16/fp16 arithmetic (no AVX512-BF16 or AMX): every "
        "matmul converts in software, measured about 4x slower than float32 on such a CPU; "
        "use dtype: auto (float32 here) unless memory is the limit", name)
