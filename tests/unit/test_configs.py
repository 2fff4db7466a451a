"""EngineConfig: strict keys and types, bounds, frozen."""

from __future__ import annotations

import pydantic
import pytest

from configs import EngineConfig


def test_defaults():
    c = EngineConfig()
    assert c.model == "builtin:tiny"
    assert c.dtype == "auto"
    assert c.device == "cpu"
    assert c.page_size == 16
    assert c.num_pages is None
    assert c.enable_prefix_caching is True
    assert c.attention_backend == "auto"


def test_valid_overrides():
    c = EngineConfig(model="/models/x", dtype="bfloat16", page_size=8, num_pages=12, max_num_seqs=2,
                     max_num_batched_tokens=64, enable_prefix_caching=False, attention_backend="torch")
    assert (c.page_size, c.num_pages, c.max_num_seqs, c.max_num_batched_tokens) == (8, 12, 2, 64)
    assert c.enable_prefix_caching is False


@pytest.mark.parametrize("key", ["page_sizes", "block_size", "max_tokens", "unknown"])
def test_unknown_key_rejected_and_named(key):
    with pytest.raises(pydantic.ValidationError) as info:
        EngineConfig(**{key: 1})
    assert key in str(info.value)
    assert info.value.errors()[0]["type"] == "extra_forbidden"
    assert info.value.errors()[0]["loc"] == (key,)


def test_unknown_key_rejected_from_dict():
    with pytest.raises(ValueError, match="prefix_caching"):
        EngineConfig.model_validate({"page_size": 8, "prefix_caching": True})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("page_size", "sixteen"),
        ("page_size", 1.5),
        ("page_size", [16]),
        ("page_size", None),
        ("num_pages", "many"),
        ("max_num_seqs", {"a": 1}),
        ("dtype", "float64"),
        ("dtype", 32),
        ("attention_backend", "flash"),
        ("enable_prefix_caching", "maybe"),
        ("enable_prefix_caching", [True]),
        ("model", 5),
        ("kv_cache_memory_bytes", "1GB"),
    ],
)
def test_wrong_type_rejected_and_named(key, value):
    with pytest.raises(pydantic.ValidationError) as info:
        EngineConfig(**{key: value})
    assert key in str(info.value)
    assert {e["loc"][0] for e in info.value.errors()} == {key}


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("page_size", 0),
        ("page_size", -4),
        ("page_size", 1025),
        ("num_pages", 0),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", 0),
        ("kv_cache_memory_bytes", 0),
        ("max_model_len", 0),
    ],
)
def test_out_of_range_rejected(key, value):
    with pytest.raises(ValueError) as info:  # pydantic.ValidationError is a ValueError
        EngineConfig(**{key: value})
    assert key in str(info.value)


def test_page_size_bounds_accepted():
    assert EngineConfig(page_size=1).page_size == 1
    assert EngineConfig(page_size=1024).page_size == 1024


def test_frozen():
    c = EngineConfig()
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        c.page_size = 32  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError):
        c.model = "other"  # type: ignore[misc]
    assert c.page_size == 16
    assert c.model == "builtin:tiny"


def test_hashable_and_equal_by_value():
    assert EngineConfig(page_size=8) == EngineConfig(page_size=8)
    assert hash(EngineConfig(page_size=8)) == hash(EngineConfig(page_size=8))
    assert EngineConfig(page_size=8) != EngineConfig(page_size=16)


def test_budget_must_cover_every_running_sequence():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be >= max_num_seqs \(16\)"):
        EngineConfig(max_num_batched_tokens=8, max_num_seqs=16)
    assert EngineConfig(max_num_batched_tokens=16, max_num_seqs=16).max_num_seqs == 16


@pytest.mark.parametrize(
    ("key", "value"),
    [("page_size", True), ("page_size", "16"), ("max_num_seqs", 2.0), ("enable_prefix_caching", "no")],
)
def test_wrong_type_not_coerced(key, value):
    with pytest.raises(pydantic.ValidationError, match=key):
        EngineConfig(**{key: value})
