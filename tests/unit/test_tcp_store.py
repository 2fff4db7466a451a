"""The stores torch.distributed groups rendezvous on listen on their configured host only
(engine/parallel/tcp_store.py): a loopback shard group's or KV group's store is not reachable
from another machine, while its ranks still meet through it. Measured on the listening sockets
themselves (/proc/net/tcp{,6}); torch's own store would show 0.0.0.0 or :: here."""

from __future__ import annotations

import gc

import pytest

from engine.kv_transfer import torch_dist
from engine.parallel.layout import ShardGroup, ShardLayout
from engine.parallel.tcp_store import open_tcp_store
from tests.helpers import listening_addresses
from tests.local_cluster import free_port


def test_a_loopback_shard_group_store_listens_on_loopback_only():
    store = ShardGroup.open_store(ShardLayout(2, 1, 0), "127.0.0.1:0", timeout_s=10)
    port = store.port
    assert port != 0
    assert listening_addresses(port) == {"127.0.0.1"}
    follower = ShardGroup.open_store(ShardLayout(2, 1, 1), f"127.0.0.1:{port}", timeout_s=10)
    follower.set("from-rank-1", "hello")
    assert store.get("from-rank-1") == b"hello"
    del follower, store
    gc.collect()
    assert listening_addresses(port) == set()  # the socket handed to torch closes with its store


def test_the_kv_groups_store_listens_on_loopback_only(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    port = free_port()
    torch_dist.join_group(0, 1, f"127.0.0.1:{port}", "gloo", timeout_s=30)
    try:
        assert listening_addresses(port) == {"127.0.0.1"}
    finally:
        torch_dist.leave_group()


def test_a_store_host_that_is_not_on_this_machine_is_named():
    with pytest.raises(OSError, match=r"cannot listen on 192\.0\.2\.1:0: .*rank 0 must run where that address is"):
        open_tcp_store("192.0.2.1", 0, 1, is_master=True, timeout_s=5)  # TEST-NET-1: never local
