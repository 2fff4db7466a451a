"""The cluster YAML keys for live metrics and logs: they load, clashing metrics ports are
named, bad values are rejected; the Prometheus file_sd targets `pdserve up` writes; the JSON
and text log formats."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest
import yaml

from cluster.launcher import metrics_targets
from configs import (
    ConfigError,
    EventLog,
    LoggingConfig,
    load_cluster_config,
    setup_logging,
)

REPO = Path(__file__).resolve().parents[2]


def load(tmp_path, **edits) -> object:
    cfg = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    for dotted, value in edits.items():
        *parents, last = dotted.split("__")
        node = cfg
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_cluster_config(path)


def test_new_keys_load_with_their_defaults_off(tmp_path):
    plain = load(tmp_path)
    assert plain.prefill.metrics_base_port is None and plain.router.slo_ttft_ms is None
    assert plain.logging == LoggingConfig(format="text", level="INFO")
    cfg = load(tmp_path, prefill__metrics_base_port=53100, decode__metrics_base_port=53200,
               prefill__peak_tflops=2, decode__peak_memory_bandwidth_gbps=30.5, router__slo_ttft_ms=500,
               router__slo_tpot_ms=50, router__slo_window_s=30, logging={"format": "json", "level": "DEBUG"})
    assert cfg.prefill.metrics_base_port == 53100 and cfg.prefill.peak_tflops == 2
    assert cfg.decode.peak_memory_bandwidth_gbps == 30.5
    assert (cfg.router.slo_ttft_ms, cfg.router.slo_tpot_ms, cfg.router.slo_window_s) == (500, 50, 30)
    assert cfg.logging.format == "json" and cfg.logging.level == "DEBUG"


@pytest.mark.parametrize(("edits", "message"), [
    ({"prefill__metrics_base_port": 52200}, "port 52200 of decode worker 0 is also prefill worker 0 metrics"),
    ({"decode__metrics_base_port": 52100}, "port 52100 of decode worker 0 metrics is also prefill worker 0"),
    ({"prefill__metrics_base_port": 50051}, "port 50051 of prefill worker 0 metrics is also router.grpc_port"),
    ({"prefill__metrics_base_port": 53000, "decode__metrics_base_port": 53000},
     "port 53000 of decode worker 0 metrics is also prefill worker 0 metrics"),
    ({"prefill__metrics_base_port": 65535, "prefill__num_workers": 2}, "prefill.metrics_base_port \\+ num_workers"),
    ({"prefill__peak_tflops": 0}, "prefill.peak_tflops"),
    ({"router__slo_ttft_ms": -1}, "router.slo_ttft_ms"),
    ({"logging": {"format": "xml"}}, "logging.format"),
    ({"logging": {"level": "LOUD"}}, "logging.level"),
    ({"logging": {"colour": True}}, "logging.colour"),
])
def test_bad_values_are_named(tmp_path, edits, message):
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, **edits)


def test_file_sd_targets_cover_router_and_every_worker(tmp_path):
    cfg = load(tmp_path, router__http_port=8000, prefill__metrics_base_port=53100, prefill__num_workers=2,
               decode__metrics_base_port=53200)
    assert metrics_targets(cfg) == [
        {"targets": ["127.0.0.1:8000"], "labels": {"job": "pdserve-router", "component": "router"}},
        {"targets": ["127.0.0.1:53100"], "labels": {"job": "pdserve-worker", "component": "prefill",
                                                    "worker_id": "prefill-0"}},
        {"targets": ["127.0.0.1:53101"], "labels": {"job": "pdserve-worker", "component": "prefill",
                                                    "worker_id": "prefill-1"}},
        {"targets": ["127.0.0.1:53200"], "labels": {"job": "pdserve-worker", "component": "decode",
                                                    "worker_id": "decode-0"}},
    ]
    assert metrics_targets(load(tmp_path)) == []  # nothing serves metrics


@pytest.fixture
def restore_root_logging():
    root = logging.getLogger()
    level = root.level
    yield
    for h in [h for h in root.handlers if getattr(h, "_pdserve", False)]:
        root.removeHandler(h)
    root.setLevel(level)


def test_json_and_text_lines(restore_root_logging):
    stream = io.StringIO()
    setup_logging(LoggingConfig(format="json"), component="decode", worker_id="decode-3", stream=stream)
    EventLog("prefill", "prefill-1").event("admitted", "req-9", prompt_tokens=12)
    logging.getLogger("somelib").warning("plain %s", "message")
    EventLog("router").event("noise", "r", level=logging.DEBUG)  # below INFO: dropped
    first, second = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert first["component"] == "prefill" and first["worker_id"] == "prefill-1"
    assert (first["event"], first["request_id"], first["fields"], first["level"]) == (
        "admitted", "req-9", {"prompt_tokens": 12}, "INFO")
    assert first["ts"] > 0
    # Records of other libraries get the process's component and worker id.
    assert (second["component"], second["worker_id"], second["event"]) == ("decode", "decode-3", "plain message")

    text = io.StringIO()
    setup_logging(LoggingConfig(format="text", level="DEBUG"), component="router", stream=text)
    EventLog("router").event("finished", "req-9", finish_reason="length")
    assert stream.getvalue().count("\n") == 2  # the JSON handler was replaced, not kept
    assert text.getvalue().rstrip().endswith("INFO router finished request_id=req-9 finish_reason=length")
