"""A role flip in the router's worker pool (router/worker_pool.py set_role): the flipped worker
is offered to its new role's placements at once, its links and status follow, and a flipped
worker's replacement (a new incarnation, in its pool's role) is routed as what it says it is."""

from __future__ import annotations

import asyncio

from proto import worker_messages as wm
from proto.frame_auth import ClusterSecret
from router.worker_pool import WorkerEndpoint, WorkerPool
from tests.local_cluster import free_port


def beat(pool: WorkerPool, worker_id: str, role: str, incarnation: str = "1") -> None:
    pool._dispatch(wm.decode(wm.encode(wm.Load(worker_id, role, 0, 10, 0, incarnation))))


def test_a_flip_moves_the_worker_between_the_roles_placements_see():
    async def run() -> None:
        endpoints = [WorkerEndpoint(w, w.split("-")[0], f"127.0.0.1:{free_port()}", f"127.0.0.1:{9000 + i}",
                                    switchable=True) for i, w in enumerate(("prefill-0", "decode-0", "decode-1"))]
        pool = WorkerPool(endpoints, f"127.0.0.1:{free_port()}", ClusterSecret.generate())
        try:
            for e in endpoints:
                beat(pool, e.worker_id, e.role)
            await pool.set_role("decode-1", "prefill", "prompts queue", "manual")
            assert sorted(w.worker_id for w in pool.loads("prefill")) == ["decode-1", "prefill-0"]
            assert [w.worker_id for w in pool.loads("decode")] == ["decode-0"]
            assert pool.link_states() == [("decode-1", "decode-0", True), ("prefill-0", "decode-0", True)]
            view = {w["worker_id"]: w for w in pool.view()}
            assert view["decode-1"]["role"] == "prefill" and view["decode-1"]["started_as"] == "decode"
            assert view["decode-1"]["last_flip"]["reason"] == "prompts queue"
            assert set(view["decode-1"]["kv_links"]) == {"decode-0"}
            beat(pool, "decode-1", "decode")  # a heartbeat built before SetRole arrived: the router's word stands
            assert pool.role("decode-1") == "prefill"
            beat(pool, "decode-1", "decode", incarnation="2")  # a replacement process, in its pool's role
            assert pool.role("decode-1") == "decode"
            assert pool.view()[1]["last_flip"]["by"] == "restart"
        finally:
            await pool.close()

    asyncio.run(run())


def test_only_prefill_and_decode_workers_switch_and_they_have_kv_addresses():
    import pytest

    with pytest.raises(ValueError, match="only prefill and decode workers are switchable"):
        WorkerEndpoint("colocated-0", "colocated", "127.0.0.1:1", "127.0.0.1:2", switchable=True)
    with pytest.raises(ValueError, match="a decode \\(or switchable\\) worker has a KV address"):
        WorkerEndpoint("prefill-0", "prefill", "127.0.0.1:1", switchable=True)
