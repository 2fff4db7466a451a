"""The router's public doors behind an API key and TLS, on a real in-process cluster serving
builtin:tiny: gRPC and HTTP refuse a missing, malformed or wrong key (UNAUTHENTICATED / 401 in
OpenAI's error shape) before reading the request, serve the right key with HF's greedy tokens,
speak TLS with a certificate made for the test, keep health checks open, and pdserve's own
clients (`pdserve generate`, `pdserve bench` over gRPC and HTTP) get through with the flags,
the environment or the cluster's YAML. A second cluster has a key without TLS and reflection
and /metrics turned off."""

from __future__ import annotations

import asyncio
import json
import ssl
import urllib.error
import urllib.request

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cluster.cli import main
from configs import EngineConfig
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc
from router.openai_http import OpenAIServer
from tests.cli_helpers import pdserve, write_config
from tests.helpers import hf_greedy
from tests.local_cluster import LocalCluster
from tests.tls_certs import self_signed

pytestmark = pytest.mark.cluster

openai = pytest.importorskip("openai")
MODEL = "builtin:tiny"
ENGINE = EngineConfig(model=MODEL, page_size=8, max_num_batched_tokens=64, max_num_seqs=8)
KEY = "pdserve-test-key-7f3a9c"
GOOD = (("authorization", f"Bearer {KEY}"),)
PROMPT = [0] + list(range(300, 320))


class Served:
    def __init__(self, cluster: LocalCluster, server: OpenAIServer, http_port: int, tmp) -> None:
        self.cluster, self.server, self.http_port, self.tmp = cluster, server, http_port, tmp

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.cluster.loop).result(10)
        self.cluster.close()


def serve(tiny_dir, tmp, **router) -> Served:
    cluster = LocalCluster(tiny_dir, "colocated", ENGINE, **router)
    server = OpenAIServer(cluster.router, tiny_dir, MODEL)
    port = asyncio.run_coroutine_threadsafe(server.start("127.0.0.1", 0), cluster.loop).result(10)
    return Served(cluster, server, port, tmp)


@pytest.fixture(scope="module")
def secured(tiny_dir, tmp_path_factory):
    """API key (from a file) and TLS on both doors."""
    tmp = tmp_path_factory.mktemp("secured")
    cert, key = self_signed(tmp)
    (tmp / "api-key").write_text(KEY + "\n")
    served = serve(tiny_dir, tmp, api_key_file=str(tmp / "api-key"), tls_cert_file=str(cert), tls_key_file=str(key))
    served.cert = cert
    yield served
    served.close()


@pytest.fixture(scope="module")
def key_only(tiny_dir, tmp_path_factory):
    """A key without TLS (a loopback deployment), reflection and /metrics off."""
    served = serve(tiny_dir, tmp_path_factory.mktemp("key-only"), api_key=KEY, grpc_reflection=False,
                   http_metrics=False)
    yield served
    served.close()


def request(prompt=PROMPT, max_tokens=8) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                              sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def refusals(served: Served) -> float:
    return served.cluster.router.metrics.errors.labels("UNAUTHENTICATED")._value.get()


# -- gRPC ------------------------------------------------------------------------------------------

def test_grpc_right_key_over_tls_matches_hf(secured, hf_tiny):
    want = hf_greedy(hf_tiny, PROMPT, 8)[0]
    stub = secured.cluster.stub  # a TLS channel trusting the test's self-signed certificate
    assert list(stub.GenerateUnary(request(), timeout=60, metadata=GOOD).token_ids) == want
    streamed = [t for r in stub.Generate(request(), timeout=60, metadata=GOOD) for t in r.token_ids]
    assert streamed == want
    secured.cluster.wait_pages_free()


@pytest.mark.parametrize(("metadata", "message"), [
    ((), "missing API key: send 'Authorization: Bearer <key>' (gRPC metadata 'authorization')"),
    ((("authorization", "Bearer wrong-key"),), "wrong API key"),
    ((("authorization", f"Bearer {KEY}x"),), "wrong API key"),
    ((("authorization", KEY),), "malformed Authorization: expected 'Bearer <key>'"),
])
@pytest.mark.parametrize("method", ["GenerateUnary", "Generate"])
def test_grpc_without_the_right_key_is_unauthenticated(secured, metadata, message, method):
    before = refusals(secured)
    call = getattr(secured.cluster.stub, method)
    with pytest.raises(grpc.RpcError) as info:
        result = call(request(), timeout=30, metadata=metadata)
        list(result) if method == "Generate" else None
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert info.value.details() == message
    assert refusals(secured) == before + 1 and secured.cluster.router.in_flight.requests == 0


def test_grpc_key_is_checked_before_the_request_is_read(secured):
    """Bytes no GenerateRequest parses from: without a key the answer is UNAUTHENTICATED, not the
    INVALID_ARGUMENT a parse would give, so nothing of the request was read."""
    call = secured.cluster.channel.unary_unary("/pdserve.v1.Generation/GenerateUnary",
                                               request_serializer=lambda b: b,
                                               response_deserializer=pb.GenerateResponse.FromString)
    with pytest.raises(grpc.RpcError) as info:
        call(b"\xff\xfe not protobuf", timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:
        call(b"\xff\xfe not protobuf", timeout=30, metadata=GOOD)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_health_is_open_and_reflection_asks_for_the_key(secured):
    health = health_pb2_grpc.HealthStub(secured.cluster.channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(secured.cluster.channel)
    ask = [reflection_pb2.ServerReflectionRequest(list_services="")]
    with pytest.raises(grpc.RpcError) as info:
        list(reflect.ServerReflectionInfo(iter(ask), timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    [reply] = reflect.ServerReflectionInfo(iter(ask), timeout=10, metadata=GOOD)
    assert "pdserve.v1.Generation" in {s.name for s in reply.list_services_response.service}


def test_a_plaintext_client_gets_nothing_from_the_tls_port(secured):
    with grpc.insecure_channel(f"127.0.0.1:{secured.cluster.port}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            pdserve_pb2_grpc.GenerationStub(channel).GenerateUnary(request(), timeout=5, metadata=GOOD)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_key_without_tls_and_reflection_off(key_only, hf_tiny):
    stub = key_only.cluster.stub  # plaintext: the router has no certificate
    assert list(stub.GenerateUnary(request(), timeout=60, metadata=GOOD).token_ids) == hf_greedy(hf_tiny, PROMPT, 8)[0]
    with pytest.raises(grpc.RpcError) as info:
        stub.GenerateUnary(request(), timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    reflect = reflection_pb2_grpc.ServerReflectionStub(key_only.cluster.channel)
    with pytest.raises(grpc.RpcError) as info:
        list(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                          timeout=10, metadata=GOOD))
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


# -- HTTP ------------------------------------------------------------------------------------------

def https(served: Served, path: str, key: str | None = None, data: bytes | None = None):
    """urllib against the TLS HTTP door, trusting the test's certificate; returns (status, headers, body)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(f"https://127.0.0.1:{served.http_port}{path}", data=data, headers=headers)
    context = ssl.create_default_context(cafile=str(served.cert))
    try:
        with urllib.request.urlopen(req, timeout=30, context=context) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


def openai_client(served: Served, key: str) -> openai.OpenAI:
    context = ssl.create_default_context(cafile=str(served.cert))
    return openai.OpenAI(base_url=f"https://127.0.0.1:{served.http_port}/v1", api_key=key, max_retries=0,
                         http_client=openai.DefaultHttpx2Client(verify=context))


def test_http_right_key_over_tls_matches_grpc(secured):
    out = openai_client(secured, KEY).completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                                         extra_body={"ignore_eos": True})
    assert out.choices[0].text == secured.cluster.stub.GenerateUnary(request(), timeout=60, metadata=GOOD).text
    assert out.usage.completion_tokens == 8


def test_http_wrong_key_is_401_in_openai_shape(secured):
    with pytest.raises(openai.AuthenticationError) as info:
        openai_client(secured, "wrong-key").completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert info.value.status_code == 401
    assert info.value.body == {"message": "wrong API key", "type": "invalid_request_error", "param": None,
                               "code": "invalid_api_key"}


@pytest.mark.parametrize(("path", "data"), [
    ("/v1/completions", b'{"prompt": "x"}'),
    ("/v1/completions", b"{not json"),  # 401, not the 400 a parse would give: the body was never read
    ("/v1/chat/completions", b"{}"),
    ("/v1/models", None),
    ("/metrics", None),
    ("/no/such/path", None),
])
def test_http_missing_key_is_401_before_any_work(secured, path, data):
    before = refusals(secured)
    status, headers, body = https(secured, path, data=data)
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    assert json.loads(body) == {"error": {"message": "missing API key: send 'Authorization: Bearer <key>' "
                                                     "(gRPC metadata 'authorization')",
                                          "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    assert refusals(secured) == before + 1


def test_http_health_is_open_and_metrics_need_the_key(secured):
    status, _, body = https(secured, "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    status, _, body = https(secured, "/metrics", key=KEY)
    assert status == 200 and b'pdserve_request_errors_total{status="UNAUTHENTICATED"}' in body


def test_plain_http_to_the_tls_port_fails(secured):
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://127.0.0.1:{secured.http_port}/health", timeout=10)


def test_http_key_without_tls_and_metrics_off(key_only):
    base = f"http://127.0.0.1:{key_only.http_port}"
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{base}/v1/models", timeout=10)
    assert info.value.code == 401
    ask = urllib.request.Request(f"{base}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(ask, timeout=10) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == [MODEL]
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(urllib.request.Request(f"{base}/metrics", headers=ask.headers), timeout=10)
    assert info.value.code == 404


# -- pdserve's own clients -------------------------------------------------------------------------

def test_pdserve_generate_with_flags_env_or_the_yaml(secured, hf_tiny, tmp_path, monkeypatch):
    prompt = "def main():"
    # What the router streams for HF's greedy tokens (its detokenizer sees the prompt too).
    reply = secured.cluster.stub.GenerateUnary(pb.GenerateRequest(text=prompt, sampling=request().sampling),
                                               timeout=60, metadata=GOOD)
    assert list(reply.token_ids) == hf_greedy(hf_tiny, secured.cluster.router.tokenizer.encode(prompt), 8)[0]
    want = reply.text
    args = ["generate", prompt, "--max-tokens", "8", "--ignore-eos"]
    address = ["--address", f"127.0.0.1:{secured.cluster.port}", "--tls-ca", str(secured.cert)]
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    refused = pdserve(*args, *address, tmp_path=tmp_path)
    assert refused.returncode == 1 and "UNAUTHENTICATED: missing API key" in refused.stderr
    by_flag = pdserve(*args, *address, "--api-key-file", str(secured.tmp / "api-key"), tmp_path=tmp_path)
    assert by_flag.returncode == 0 and by_flag.stdout == want, by_flag.stderr
    monkeypatch.setenv("PDSERVE_API_KEY", KEY)
    by_env = pdserve(*args, *address, tmp_path=tmp_path)
    assert by_env.returncode == 0 and by_env.stdout == want, by_env.stderr
    # --config: the key and the certificate to trust come from the router section of the YAML.
    monkeypatch.delenv("PDSERVE_API_KEY")
    config = write_config(tmp_path, "colocated")
    cfg = yaml.safe_load(config.read_text())
    cfg["router"].update(grpc_port=secured.cluster.port, api_key_file=str(secured.tmp / "api-key"),
                         tls_cert_file=str(secured.cert), tls_key_file=str(secured.tmp / "router-key.pem"))
    config.write_text(yaml.safe_dump(cfg))
    by_yaml = pdserve(*args, "--config", str(config), tmp_path=tmp_path)
    assert by_yaml.returncode == 0 and by_yaml.stdout == want, by_yaml.stderr


@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_pdserve_bench_through_both_doors(secured, backend, tmp_path, monkeypatch, capsys):
    address = f"127.0.0.1:{secured.cluster.port}" if backend == "grpc" else f"https://127.0.0.1:{secured.http_port}"
    argv = ["bench", "--backend", backend, "--address", address, "--tls-ca", str(secured.cert), "--num-prompts", "3",
            "--input-len", "8", "--output-len", "4", "--warmup", "0", "--label", backend, "--out", str(tmp_path),
            "--no-progress", "--no-plots"]
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    if backend == "openai":  # the model lookup is refused, and says why
        assert main(argv) == 2
        assert "refused the API key (HTTP 401): give it with $PDSERVE_API_KEY" in capsys.readouterr().err
    else:  # every request is refused and counted as failed
        assert main(argv) == 1
        records = json.loads((tmp_path / "grpc.json").read_text())["runs"][0]["requests"]
        assert {r["error"] for r in records} == {"UNAUTHENTICATED"}
    monkeypatch.setenv("PDSERVE_API_KEY", KEY)
    assert main(argv) == 0
    records = json.loads((tmp_path / f"{backend}.json").read_text())["runs"][0]["requests"]
    assert len(records) == 3 and all(r["ok"] and r["output_tokens"] == 4 for r in records)


@pytest.mark.ray
def test_pdserve_demo_with_a_secured_router(secured, hf_tiny, tmp_path, monkeypatch):
    """The whole `pdserve up` path (Ray actors; the router actor gets the key's digest and the
    certificate paths in its spec) and `demo`'s client taking the key and certificate from the YAML."""
    prompt = "def fibonacci(n):"
    reply = secured.cluster.stub.GenerateUnary(
        pb.GenerateRequest(text=prompt, sampling=pb.SamplingParams(max_tokens=16, ignore_eos=True)),
        timeout=60, metadata=GOOD)
    assert list(reply.token_ids) == hf_greedy(hf_tiny, secured.cluster.router.tokenizer.encode(prompt), 16)[0]
    config = write_config(tmp_path, "colocated")
    cfg = yaml.safe_load(config.read_text())
    cfg["router"].update(api_key_env="PDSERVE_API_KEY", tls_cert_file=str(secured.cert),
                         tls_key_file=str(secured.tmp / "router-key.pem"))
    config.write_text(yaml.safe_dump(cfg))
    args = ["demo", str(config), prompt, "--max-tokens", "16", "--ignore-eos"]
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    unset = pdserve(*args, tmp_path=tmp_path)  # refused before Ray or any worker starts
    assert unset.returncode == 2
    assert "router.api_key_env: the environment variable PDSERVE_API_KEY is not set" in unset.stderr
    monkeypatch.setenv("PDSERVE_API_KEY", KEY)
    proc = pdserve(*args, tmp_path=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"router: serving gRPC on 127.0.0.1:{cfg['router']['grpc_port']}" in proc.stdout
    assert "(TLS, API key)" in proc.stdout and KEY not in proc.stdout + proc.stderr
    assert prompt + reply.text in proc.stdout and "cluster stopped" in proc.stdout
