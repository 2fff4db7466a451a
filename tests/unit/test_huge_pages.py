"""engine/huge_pages.py: the KV cache and packed weights end up on transparent huge pages, and
every refusal leaves the buffer as it was."""

from __future__ import annotations

import pytest
import torch

from engine import huge_pages
from engine.kv_cache import KVCache
from engine.model.config import ModelConfig
from kernels import packed_linear

BIG = 64 << 20  # bytes of one test buffer (see test_advised_memory_faults_in_as_huge_pages)
needs_thp = pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages here (not Linux, "
                               "or THP set to never)")


def huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's header line: start-end perms ...
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    return 0


@needs_thp
def test_advised_memory_faults_in_as_huge_pages():
    # 64 MiB: above glibc's largest mmap threshold (32 MiB), so a fresh mapping, as a real KV
    # cache's per-layer tensors are; a smaller block may come back from the heap already
    # touched (in 4 KiB pages), which advice cannot change.
    tensor = torch.empty(BIG, dtype=torch.uint8)
    assert huge_pages.advise(tensor) >= BIG - (4 << 20)  # the whole 2 MiB pages inside
    tensor.zero_()
    assert huge_bytes_at(tensor.data_ptr() + (4 << 20)) >= 2 << 20


@needs_thp
def test_kv_cache_pages_are_huge_and_zero():
    cfg = ModelConfig("llama", vocab_size=64, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=1e4,
                      rope_scaling=(), tie_word_embeddings=False, qkv_bias=False, o_bias=False, bos_token_id=0,
                      eos_token_ids=(1,))
    cache = KVCache(cfg, num_pages=BIG // (16 * 2 * 64 * 4), page_size=16, dtype=torch.float32, device="cpu")
    for tensor in (*cache.k, *cache.v):
        assert huge_bytes_at(tensor.data_ptr() + (4 << 20)) >= 2 << 20
        assert not tensor.any()


@needs_thp
def test_packed_weights_collapse_onto_huge_pages():
    weight = torch.randn(4096, 1024)  # 16 MiB
    packed = packed_linear.pack(weight)
    if packed is None:
        pytest.skip("this torch has no oneDNN packing")
    address, size = huge_pages.byte_range(packed)
    assert size == weight.numel() * 4
    assert huge_pages.collapse([packed]) >= 8 << 20
    assert huge_bytes_at(address + (8 << 20)) >= 2 << 20
    x = torch.randn(3, 1024)  # the data moved pages, not values
    torch.testing.assert_close(packed_linear.apply(x, packed, None), x @ weight.T, rtol=1e-4, atol=1e-3)


def test_what_cannot_be_huge_is_left_alone(monkeypatch):
    small = torch.ones(1000)
    assert huge_pages.advise(small) == 0 and huge_pages.collapse([small]) == 0  # no whole 2 MiB page
    assert huge_pages.advise(torch.empty(8 << 20, dtype=torch.uint8, device="meta")) == 0
    monkeypatch.setattr(huge_pages, "_MADVISE", None)  # not Linux
    big = torch.zeros(8 << 20, dtype=torch.uint8)
    assert not huge_pages.available() and huge_pages.collapse([big]) == 0
    assert not big.any()
