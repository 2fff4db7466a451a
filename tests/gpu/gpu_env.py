"""What every tests/gpu/ module checks first: a CUDA device, and compiled (not interpreted)
Triton kernels. All of tests/gpu/ but the two-GPU NCCL test ran on an H200 on 2026-12-04."""

from __future__ import annotations

import os

import pytest
import torch

# The root conftest defaults TRITON_INTERPRET to 0 where CUDA exists; a module of tests/kernels/
# collected in the same session sets it to 1 before the kernels are first imported, and from
# then on every kernel runs in the interpreter. Say so instead of timing the interpreter.
# Without CUDA the root conftest's reason ("needs CUDA") is the one shown.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and torch.cuda.is_available()

requires_compiled_triton = pytest.mark.skipif(
    INTERPRETED, reason="TRITON_INTERPRET=1 in this session: run tests/gpu/ on its own (scripts/gpu_check.sh)")


def cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
