"""The wire contract: committed generated code matches the .proto, and messages round-trip."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_generated_code_is_not_stale(tmp_path):
    pytest.importorskip("grpc_tools")
    import importlib.util

    spec = importlib.util.spec_from_file_location("proto_generate", REPO / "proto" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    fresh = generate.generate(tmp_path)
    assert fresh, "nothing generated"
    for path in fresh:
        committed = REPO / "proto" / path.name
        assert committed.is_file(), f"{path.name} is generated but not committed: run python proto/generate.py"
        assert committed.read_bytes() == path.read_bytes(), f"{path.name} is stale: run python proto/generate.py"


def test_request_round_trip_and_optional_fields():
    from proto import pdserve_pb2 as pb

    req = pb.GenerateRequest(request_id="r1", text="def f():",
                             sampling=pb.SamplingParams(max_tokens=8, top_p=0.5, stop=["\n\n"]))
    back = pb.GenerateRequest.FromString(req.SerializeToString())
    assert back.WhichOneof("prompt") == "text" and back.text == "def f():"
    assert back.sampling.HasField("max_tokens") and back.sampling.max_tokens == 8
    assert not back.sampling.HasField("temperature")  # unset: the engine default applies
    assert list(back.sampling.stop) == ["\n\n"]
    ids = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[0, 5, 7]))
    assert pb.GenerateRequest.FromString(ids.SerializeToString()).token_ids.ids == [0, 5, 7]


def test_service_has_streaming_and_unary_generate():
    from proto import pdserve_pb2 as pb
    from proto import pdserve_pb2_grpc  # noqa: F401  (the stubs import cleanly)

    service = pb.DESCRIPTOR.services_by_name["Generation"]
    methods = {m.name: m for m in service.methods}
    assert methods["Generate"].server_streaming and not methods["Generate"].client_streaming
    assert not methods["GenerateUnary"].server_streaming
