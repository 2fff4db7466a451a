"""The cluster YAML schema: the shipped examples load, and each kind of mistake is rejected
with the offending key named."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
import yaml

from configs import ClusterConfig, ConfigError, EngineConfig, load_cluster_config

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "configs").glob("*.yaml"))


def test_there_are_examples():
    assert {p.name for p in EXAMPLES} >= {"local.yaml", "colocated.yaml", "gpu.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_load(path):
    cfg = load_cluster_config(path)
    pools = [p for p in (cfg.prefill, cfg.decode, cfg.colocated) if p is not None]
    assert pools
    for pool in pools:
        engine = cfg.engine_config(pool)
        assert isinstance(engine, EngineConfig) and engine.model == cfg.model


def test_local_example_is_one_prefill_one_decode_on_the_tiny_model():
    cfg = load_cluster_config(REPO / "configs" / "local.yaml")
    assert cfg.model == "builtin:tiny" and cfg.mode == "disaggregated"
    assert cfg.prefill.num_workers == cfg.decode.num_workers == 1
    assert cfg.engine_config(cfg.decode).device == "cpu"


def base() -> dict:
    return yaml.safe_load((REPO / "configs" / "local.yaml").read_text())


def edit(path: str, value):
    cfg = base()
    *parents, last = path.split(".")
    node = cfg
    for key in parents:
        node = node.setdefault(key, {})
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return cfg


DELETE = object()


def sharded(role: str, **pool) -> dict:
    cfg = edit(f"{role}.engine.tensor_parallel_size", 2)
    cfg[role].update({"shard_base_port": 53000, **pool})
    return cfg


def switching(**settings) -> dict:
    """local.yaml with switchable workers (the prefill pool receives KV too) and `settings`."""
    cfg = edit("router.role_switching", {"mode": "manual", **settings})
    cfg["prefill"]["kv_base_port"] = 52500
    return cfg


def test_switchable_workers_have_a_kv_address_whatever_their_pool():
    from cluster.specs import kv_destinations, worker_spec
    from configs import ClusterConfig
    from proto.frame_auth import ClusterSecret

    config = ClusterConfig.model_validate(switching())
    specs = [worker_spec(config, role, 0, "10.0.0.7", "10.0.0.1", ClusterSecret.generate()) for role in ("prefill", "decode")]
    assert [(s.switchable, s.kv_address) for s in specs] == [(True, "10.0.0.7:52500"), (True, "10.0.0.7:52400")]
    assert kv_destinations(specs) == ("10.0.0.7:52400", "10.0.0.7:52500")


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (edit("router.grpc_portt", 1), r"router\.grpc_portt: Extra inputs are not permitted"),
        (edit("prefill.engine.page_siz", 8), r"prefill\.engine\.page_siz: Extra inputs are not permitted"),
        (edit("decode.num_workers", "2"), r"decode\.num_workers: Input should be a valid integer"),
        (edit("decode.num_workers", 0), r"decode\.num_workers: Input should be greater than or equal to 1"),
        (edit("router.grpc_port", 70000), r"router\.grpc_port: Input should be less than or equal to 65535"),
        (edit("kv_transfer.transport", "carrier-pigeon"), r"kv_transfer\.transport: Input should be 'zmq' or"),
        (edit("model", DELETE), r"model: Field required"),
        (edit("decode", DELETE), "needs both 'prefill' and 'decode' pools"),
        (edit("mode", "colocated"), "mode 'colocated' needs a 'colocated' pool"),
        (edit("decode.engine.page_size", 32), "page_size must be equal"),
        (edit("decode.base_port", 52100), "port 52100 of decode worker 0 is also prefill worker 0"),
        (edit("router.grpc_port", 52200), "port 52200 of decode worker 0 is also router.grpc_port"),
        (edit("decode.engine.max_num_seqs", 4096), r"max_num_batched_tokens \(2048\) must be >= max_num_seqs"),
        (edit("prefill.engine.tensor_parallel_size", 2),
         r"prefill: tensor_parallel_size x pipeline_parallel_size = 2 needs shard_base_port"),
        (sharded("prefill", placement_strategy="SPREAD"), "tensor-parallel shards all-reduce in every layer"),
        (sharded("decode", shard_base_port=52200), "port 52200 of decode worker 0 shard group is also decode worker 0"),
        (edit("router.max_prefill_queue_tokens", 0),
         r"router\.max_prefill_queue_tokens: Input should be greater than or equal to 1"),
        (edit("router.max_prefill_queue_tokens", "many"), r"router\.max_prefill_queue_tokens: Input should be a valid integer"),
        (edit("prefill.engine.dtype", "float64"), r"prefill\.engine\.dtype: Input should be 'auto'"),
        (edit("decode.engine.speculative", {"method": "draft"}),
         r"decode\.engine\.speculative: speculative\.method 'draft' needs speculative\.draft_model"),
        (edit("router.disaggregation", "sometimes"), r"router\.disaggregation: Input should be 'always', 'adaptive'"),
        (edit("router.slo_ttft_ms", 0), r"router\.slo_ttft_ms: Input should be greater than 0"),
        (edit("router.slo_admission_factor", 2.0), "slo_admission_factor needs slo_ttft_ms"),
        (edit("router.slo_admission_factor", 0.5), r"router\.slo_admission_factor: Input should be greater than or equal to 1"),
        (edit("router.placement.margin", 1.0), r"router\.placement\.margin: Input should be less than 1"),
        (edit("decode.engine.speculative", {"max_batch_seqs": -1}),
         r"decode\.engine\.speculative\.max_batch_seqs: Input should be greater than or equal to 0"),
        (edit("flight_recorder", {"capacity": 0}), r"flight_recorder\.capacity: Input should be greater than or equal to 16"),
        (edit("flight_recorder", {"overrun_grace_s": 0}), r"flight_recorder\.overrun_grace_s: Input should be greater than 0"),
        (edit("flight_recorder", {"dump_dri": "/tmp"}), r"flight_recorder\.dump_dri: Extra inputs are not permitted"),
        (edit("router.role_switching", {"mode": "sometimes"}), r"router\.role_switching\.mode: Input should be 'off'"),
        (edit("router.role_switching", {"mode": "manual"}), "role_switching needs prefill.kv_base_port"),
        (switching(mode="auto"), "role_switching.mode auto needs slo_ttft_ms and slo_tpot_ms"),
        (switching(low=0.9), r"role_switching\.low \(0\.9\) must be under role_switching\.high"),
        (switching(max_flips=0), r"router\.role_switching\.max_flips: Input should be greater than or equal to 1"),
        ({**switching(), "kv_transfer": {"transport": "torch_dist"}}, "role_switching needs kv_transfer.transport: zmq"),
        (edit("prefill.kv_base_port", 52400), "port 52400 of decode worker 0 KV is also prefill worker 0 KV"),
    ],
)
def test_mistakes_are_rejected_naming_the_key(tmp_path, cfg, message):
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match=message) as info:
        load_cluster_config(path)
    assert str(path) in str(info.value)


def test_a_decode_pool_may_speculate_with_a_draft_model(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(edit("decode.engine.speculative", {"method": "draft", "draft_model": "/models/d"})))
    cfg = load_cluster_config(path)
    speculative = cfg.engine_config(cfg.decode).speculative
    assert (speculative.method, speculative.draft_model, speculative.max_batch_seqs) == ("draft", "/models/d", 4)


def test_unreadable_files_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_cluster_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_cluster_config(tmp_path / "list.yaml")
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_cluster_config(tmp_path / "bad.yaml")


def test_config_is_frozen():
    cfg = ClusterConfig.model_validate(base())
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.router.grpc_port = 1  # type: ignore[misc]
