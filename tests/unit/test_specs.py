"""cluster/specs.py: the cluster YAML becomes each process's frozen spec in one place, and every
engine setting a process needs reaches it (max_model_len and cache_dir reach the router)."""

from __future__ import annotations

import grpc
import pytest

from cluster.specs import WorkerSpec, kv_destinations, model_cache_dir, router_spec, worker_spec
from configs import ClusterConfig, EngineConfig
from engine.model.loader import resolve_model_path
from proto import pdserve_pb2 as pb
from proto.frame_auth import ClusterSecret
from router.journey_state import RouterError
from router.server import Router
from router.validation import validate

SECRET = ClusterSecret.generate()

def cluster(prefill_engine: dict | None = None, decode_engine: dict | None = None, **extra) -> ClusterConfig:
    return ClusterConfig.model_validate({
        "model": "builtin:tiny",
        "prefill": {"num_workers": 2, "base_port": 52100, "engine": prefill_engine or {}},
        "decode": {"num_workers": 1, "base_port": 52200, "kv_base_port": 52400, "metrics_base_port": 52600,
                   "peak_tflops": 1.5, "engine": decode_engine or {}},
        **extra,
    })


def test_the_engines_max_model_len_reaches_the_router(tiny_dir):
    config = cluster({"max_model_len": 128}, {"max_model_len": 64})
    spec = router_spec(config, str(tiny_dir), [], "127.0.0.1", SECRET)
    assert spec.max_model_len == 64  # the smallest engine limit: a longer prompt fits no decode worker
    router = Router(spec)
    assert router.max_model_len == 64
    long = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 64))
    with pytest.raises(RouterError) as err:
        validate(long, router.tokenizer, router.max_model_len, 60.0)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "context is 64 tokens" in str(err.value)
    fits = validate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 60)), router.tokenizer, 64, 60.0)
    assert fits.sampling.max_tokens == 4  # clipped to what the context leaves
    assert Router(router_spec(cluster(), str(tiny_dir), [], "127.0.0.1", SECRET)).max_model_len == 2048  # the model's


def test_the_engines_cache_dir_is_where_the_router_finds_the_model(tmp_path):
    config = cluster({"cache_dir": str(tmp_path)}, {"cache_dir": str(tmp_path)})
    assert model_cache_dir(config) == str(tmp_path)
    assert model_cache_dir(cluster()) is None  # the default ~/.cache/pdserve (or $PDSERVE_CACHE)
    model_dir = resolve_model_path(config.model, model_cache_dir(config))  # what the launcher does
    assert model_dir.parent == tmp_path and (model_dir / "tokenizer.json").is_file()


def test_router_spec_carries_the_yaml_router_section_and_kv_deadlines(tiny_dir):
    config = cluster(router={"slo_ttft_ms": 250.0, "max_attempts": 5, "worker_event_port": 53000},
                     kv_transfer={"timeout_s": 7.0, "reservation_lease_s": 9.0})
    spec = router_spec(config, str(tiny_dir), [], "10.0.0.5", SECRET)
    assert (spec.router.slo_ttft_ms, spec.router.max_attempts) == (250.0, 5)
    assert (spec.kv_timeout_s, spec.lease_s, spec.event_address) == (7.0, 9.0, "10.0.0.5:53000")
    assert spec.mode == "disaggregated" and spec.model_name == "builtin:tiny"
    decode = worker_spec(config, "decode", 0, "127.0.0.1", "127.0.0.1", SECRET)
    assert (decode.max_lease_s, decode.max_transfer_s) == (9.0, 7.0)  # what a ReserveKV / Prefill is cut to


def test_worker_specs_take_their_index_ports_and_the_pool_engine():
    config = cluster({"page_size": 8}, {"page_size": 8, "max_num_seqs": 4})
    prefill = worker_spec(config, "prefill", 1, "127.0.0.1", "127.0.0.1", SECRET)
    assert (prefill.worker_id, prefill.command_port, prefill.kv_port, prefill.metrics_port) == ("prefill-1", 52101,
                                                                                               None, None)
    assert prefill.engine == EngineConfig(model="builtin:tiny", page_size=8)
    decode = worker_spec(config, "decode", 0, "127.0.0.1", "127.0.0.1", SECRET)
    assert (decode.kv_port, decode.metrics_port, decode.peak_tflops) == (52400, 52600, 1.5)
    assert decode.engine.max_num_seqs == 4 and decode.router_event_address == "127.0.0.1:52000"


def test_torch_dist_workers_get_their_rank_in_the_kv_group():
    config = cluster(kv_transfer={"transport": "torch_dist", "dist_port": 52500})
    ranks = [worker_spec(config, role, i, "127.0.0.1", "10.0.0.5", SECRET) for role, i in
             (("prefill", 0), ("prefill", 1), ("decode", 0))]
    assert [(s.dist_rank, s.dist_world_size) for s in ranks] == [(0, 3), (1, 3), (2, 3)]
    assert {s.dist_store_address for s in ranks} == {"10.0.0.5:52500"}
    assert [s.dist_sources for s in ranks] == [(), (), (0, 1)]  # decode receives from the prefill ranks by name


def test_the_kv_destinations_are_the_decode_workers_kv_addresses_as_bound():
    """What every prefill worker is told it may push KV to (cluster/kv_destinations.py): each
    decode worker's address exactly as its Reserved replies name it, with the host it bound."""
    from dataclasses import replace

    from engine.kv_transfer.torch_dist import address_of
    from engine.kv_transfer.zmq_transport import ZmqFrameReceiver

    config = cluster()
    specs = [worker_spec(config, role, i, "node", "127.0.0.1", SECRET) for role, i in
             (("prefill", 0), ("prefill", 1), ("decode", 0))]
    bound = [replace(s, host="10.0.0.7") for s in specs]  # what WorkerActor.ready() reports
    assert [s.kv_address for s in bound] == [None, None, "10.0.0.7:52400"]
    assert kv_destinations(bound) == ("10.0.0.7:52400",)
    receiver = ZmqFrameReceiver("127.0.0.1", 0, SECRET)
    try:
        assert replace(bound[2], host="127.0.0.1", kv_port=receiver.port).kv_address == receiver.address
    finally:
        receiver.close()
    dist = cluster(kv_transfer={"transport": "torch_dist", "dist_port": 52500})
    ranks = [worker_spec(dist, role, i, "127.0.0.1", "127.0.0.1", SECRET) for role, i in
             (("prefill", 0), ("prefill", 1), ("decode", 0))]
    # torch_dist: the decode rank, and its ZMQ port for pairs whose torch.distributed link died
    assert kv_destinations(ranks) == ("127.0.0.1:52400", address_of(2))
    assert ranks[2].kv_fallback_address == "127.0.0.1:52400" and ranks[0].kv_source == "dist:0"
    assert ranks[0].dist_sinks == (2,) and ranks[2].dist_sources == (0, 1)
    assert (ranks[0].dist_timeout_s, ranks[0].link_heartbeat_s) == (120.0, 5.0)
    assert bound[2].kv_fallback_address is None and bound[0].kv_source is None  # zmq: neither


def test_the_router_knows_each_decode_workers_kv_address_as_bound():
    """The endpoint the router is given for a ready worker carries the KV address its Reserved
    replies must name (router/attempt.py checks them); before ready() it has none to give."""
    from dataclasses import replace

    from cluster.worker_launch import WorkerSlot
    from router.worker_pool import WorkerEndpoint

    config = cluster()
    slots = {role: WorkerSlot(f"{role}-0", role, 0, actor=None, command_address="node:1") for role in ("prefill", "decode")}
    with pytest.raises(RuntimeError, match="has not reported ready"):
        slots["decode"].endpoint()
    for role, slot in slots.items():
        slot.resolve(replace(worker_spec(config, role, 0, "node", "127.0.0.1", SECRET), host="10.0.0.7"))
    assert slots["decode"].endpoint() == WorkerEndpoint("decode-0", "decode", "10.0.0.7:52200", "10.0.0.7:52400")
    assert slots["prefill"].endpoint() == WorkerEndpoint("prefill-0", "prefill", "10.0.0.7:52100")
    with pytest.raises(ValueError, match="a decode \\(or switchable\\) worker has a KV address"):
        WorkerEndpoint("decode-0", "decode", "10.0.0.7:52200")
    with pytest.raises(ValueError, match="no other has one"):
        WorkerEndpoint("prefill-0", "prefill", "10.0.0.7:52100", "10.0.0.7:52400")


@pytest.mark.parametrize(("fields", "message"), [
    ({"role": "router"}, "unknown worker role 'router'"),
    ({"role": "decode"}, "a decode worker needs a kv_port"),
    ({"kv_transport": "rdma"}, "unknown KV transport 'rdma'"),
    ({"kv_transport": "torch_dist", "dist_rank": 0}, "needs dist_rank, dist_world_size and dist_store_address"),
])
def test_a_worker_spec_that_cannot_run_is_refused(fields, message):
    base = {"role": "prefill", "worker_id": "prefill-0", "engine": EngineConfig(), "host": "127.0.0.1",
            "command_port": 1, "router_event_address": "127.0.0.1:2", "cluster_secret": SECRET}
    with pytest.raises(ValueError, match=message):
        WorkerSpec(**(base | fields))


@pytest.mark.parametrize(("router", "ray_address", "internal"), [
    ({"host": "127.0.0.1"}, None, "127.0.0.1"),
    ({"host": "0.0.0.0"}, None, "127.0.0.1"),  # an embedded cluster: internal sockets stay on loopback
    ({"host": "0.0.0.0", "internal_host": "10.1.2.3"}, "auto", "10.1.2.3"),
    ({"host": "192.168.0.9"}, "auto", "192.168.0.9"),
])
def test_internal_sockets_never_bind_the_public_wildcard(tiny_dir, router, ray_address, internal):
    from cluster.worker_launch import worker_host

    config = cluster(router=router, ray={"address": ray_address})
    assert worker_host(config) == internal
    assert router_spec(config, str(tiny_dir), [], worker_host(config), SECRET).event_address == f"{internal}:52000"
