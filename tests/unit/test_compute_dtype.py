"""dtype `auto` and the warning for bfloat16 on a CPU that lacks it (engine/model/compute_dtype.py)."""

import logging

import pytest
import torch

from engine.model import compute_dtype


@pytest.fixture
def cpu(monkeypatch):
    """Sets whether the CPU has native bf16; returns a setter."""
    compute_dtype._warn_slow_dtype.cache_clear()

    def set_native(native: bool) -> None:
        monkeypatch.setattr(compute_dtype, "cpu_has_native_bf16", lambda: native)

    return set_native


def test_auto_is_bf16_only_where_it_is_fast(cpu):
    cpu(False)
    assert compute_dtype.resolve_dtype("auto", "cpu") == torch.float32
    assert compute_dtype.resolve_dtype("auto", "cuda:0") == torch.bfloat16
    cpu(True)
    assert compute_dtype.resolve_dtype("auto", "cpu") == torch.bfloat16


def test_explicit_bf16_on_a_cpu_without_it_warns_once_with_the_cost(cpu, caplog):
    cpu(False)
    with caplog.at_level(logging.WARNING, logger="engine.model.compute_dtype"):
        assert compute_dtype.resolve_dtype("bfloat16", "cpu") == torch.bfloat16
        compute_dtype.resolve_dtype("bfloat16", "cpu")
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "4x slower than float32" in warnings[0]
    caplog.clear()
    cpu(True)
    compute_dtype._warn_slow_dtype.cache_clear()
    with caplog.at_level(logging.WARNING, logger="engine.model.compute_dtype"):
        compute_dtype.resolve_dtype("bfloat16", "cpu")
        compute_dtype.resolve_dtype("float32", "cpu")
    assert not caplog.records


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="float64"):
        compute_dtype.resolve_dtype("float64", "cpu")


def test_cpu_flag_reading_can_be_forced(monkeypatch):
    compute_dtype.cpu_has_native_bf16.cache_clear()
    try:
        monkeypatch.setenv("PDSERVE_CPU_NATIVE_BF16", "1")
        assert compute_dtype.cpu_has_native_bf16() is True
        compute_dtype.cpu_has_native_bf16.cache_clear()
        monkeypatch.setenv("PDSERVE_CPU_NATIVE_BF16", "0")
        assert compute_dtype.cpu_has_native_bf16() is False
    finally:
        compute_dtype.cpu_has_native_bf16.cache_clear()
