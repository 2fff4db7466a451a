"""SamplingParams validation: every bad value fails with the field named."""

from __future__ import annotations

import dataclasses
import math

import pytest

from engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -1),
        ("max_tokens", 1.5),
        ("max_tokens", 2.0),
        ("max_tokens", True),
        ("max_tokens", "16"),
        ("max_tokens", None),
        ("temperature", -1),
        ("temperature", -0.01),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", True),
        ("temperature", "0.5"),
        ("top_p", 0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -0.5),
        ("top_p", float("nan")),
        ("top_p", float("inf")),
        ("top_k", -1),
        ("top_k", 1.5),
        ("top_k", True),
        ("seed", "x"),
        ("seed", 1.0),
        ("seed", True),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1, -5]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", ["3"]),
    ],
)
def test_invalid_value_raises_naming_field(field, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    assert field in str(info.value)


def test_defaults_are_valid_and_greedy():
    p = SamplingParams()
    assert p.max_tokens == 16
    assert p.temperature == 0.0
    assert p.top_k == 0
    assert p.top_p == 1.0
    assert p.seed is None
    assert p.stop_token_ids == ()
    assert p.ignore_eos is False
    assert p.logprobs is False
    assert p.greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=1),
        dict(temperature=0),
        dict(temperature=0.7, top_k=50, top_p=0.9, seed=0),
        dict(temperature=2, top_p=1),
        dict(top_p=1e-9),
        dict(seed=-3),
        dict(stop_token_ids=[0, 5]),
        dict(stop_token_ids=()),
    ],
)
def test_valid_values_accepted(kwargs):
    p = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        got = getattr(p, key)
        assert got == (tuple(value) if key == "stop_token_ids" else value)


def test_greedy_iff_temperature_zero():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    assert not SamplingParams(temperature=1.0).greedy


def test_list_stop_token_ids_becomes_tuple_and_params_hashable():
    p = SamplingParams(stop_token_ids=[3, 4])
    assert p.stop_token_ids == (3, 4)
    assert isinstance(p.stop_token_ids, tuple)
    assert hash(p) == hash(SamplingParams(stop_token_ids=(3, 4)))
    assert p == SamplingParams(stop_token_ids=(3, 4))


def test_stop_token_ids_accepts_generator():
    p = SamplingParams(stop_token_ids=(i for i in [1, 2]))
    assert p.stop_token_ids == (1, 2)


def test_frozen():
    p = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_tokens = 3  # type: ignore[misc]


def test_nan_message_mentions_value():
    with pytest.raises(ValueError, match="temperature") as info:
        SamplingParams(temperature=math.nan)
    assert "nan" in str(info.value)


def test_non_iterable_stop_token_ids_raises_value_error_naming_field():
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=5)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_out_of_range_seed_rejected_or_usable(seed):
    from engine.sequence import Sequence

    try:
        p = SamplingParams(seed=seed)
    except ValueError as e:  # rejecting it with the field named is fine
        assert "seed" in str(e)
        return
    seq = Sequence("r", [1, 2], p, arrival_index=0, max_total_tokens=16)  # must not raise
    assert seq.generator is not None
