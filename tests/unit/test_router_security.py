"""The public doors' API key and TLS settings without a server: the YAML's checks and their
messages, where the key comes from, the constant-time check's verdicts, that no repr shows the
key, that a spec never silently drops a configured key, and what pdserve's own clients present
(cluster/client_auth.py). The servers themselves: tests/integration/test_api_key_tls.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from cluster.cli import build_parser
from cluster.client_auth import client_auth
from cluster.dry_run import plan
from cluster.launcher import metrics_targets
from configs import ClusterConfig, ConfigError, load_cluster_config
from configs.cluster import RouterConfig
from loadgen.credentials import ClientAuth
from proto.frame_auth import ClusterSecret
from router.security import ApiKey, FrontDoorSecurity, load_api_key, read_api_key
from router.spec import RouterSpec
from tests.tls_certs import self_signed

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-test-0123456789abcdef"


def load_with(tmp_path, **router) -> ClusterConfig:
    """configs/local.yaml with these router keys, loaded as `pdserve up` loads it."""
    cfg = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    cfg["router"].update(router)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_cluster_config(path)


@pytest.mark.parametrize(("router", "message"), [
    ({"tls_cert_file": "c.pem"}, "router: tls_cert_file needs tls_key_file: TLS takes a certificate and its private key"),
    ({"tls_key_file": "k.pem"}, "router: tls_key_file needs tls_cert_file"),
    ({"api_key": KEY, "api_key_env": "PDSERVE_API_KEY"}, "router: give the API key one way, not api_key and api_key_env"),
    ({"api_key_env": "A", "api_key_file": "k"}, "not api_key_env and api_key_file"),
    ({"api_key_env": ""}, "router.api_key_env: String should have at least 1 character"),
    ({"grpc_reflection": "no"}, "router.grpc_reflection: Input should be a valid boolean"),
    ({"api_key": 12345}, "router.api_key: Input should be a valid string"),
])
def test_config_mistakes_are_named(tmp_path, router, message):
    with pytest.raises(ConfigError, match="invalid cluster config") as info:
        load_with(tmp_path, **router)
    assert message in str(info.value)


def test_defaults_are_as_before():
    r = RouterConfig()
    assert not r.wants_api_key and not r.wants_tls and r.grpc_reflection and r.http_metrics
    assert load_api_key(r) is None and not FrontDoorSecurity.load(r).tls


def test_the_key_never_shows_in_a_repr(tmp_path):
    cfg = load_with(tmp_path, api_key=KEY)
    security = FrontDoorSecurity.load(cfg.router)
    for text in (repr(cfg), repr(cfg.router), str(cfg.model_dump()), repr(security), repr(security.api_key),
                 repr(ClientAuth(api_key=KEY))):
        assert KEY not in text


def test_key_sources(tmp_path):
    (tmp_path / "key").write_text(f"  {KEY}\n")
    assert read_api_key(RouterConfig(api_key_file=str(tmp_path / "key"))) == KEY
    assert read_api_key(RouterConfig(api_key_env="MY_KEY"), {"MY_KEY": KEY}) == KEY
    assert read_api_key(RouterConfig.model_validate({"api_key": KEY})) == KEY
    with pytest.raises(ValueError, match="router.api_key_env: the environment variable MY_KEY is not set"):
        read_api_key(RouterConfig(api_key_env="MY_KEY"), {})
    with pytest.raises(ValueError, match="router.api_key_file: cannot read .*nope"):
        read_api_key(RouterConfig(api_key_file=str(tmp_path / "nope")))
    with pytest.raises(ValueError, match=r"router.api_key_env \(MY_KEY\): the API key must be non-empty printable "
                                         "ASCII without spaces"):
        read_api_key(RouterConfig(api_key_env="MY_KEY"), {"MY_KEY": "two words"})


def test_check_verdicts():
    key = ApiKey(KEY)
    assert key.check(f"Bearer {KEY}") is None and key.check(f"bearer  {KEY} ") is None
    assert key.check(None).startswith("missing API key")
    assert key.check(KEY).startswith("malformed Authorization")
    assert key.check(f"Basic {KEY}").startswith("malformed Authorization")
    assert key.check(f"Bearer {KEY}x") == "wrong API key"
    assert key.check(f"Bearer {KEY[:-1]}") == "wrong API key"


def test_tls_files_are_checked_at_load(tmp_path):
    cert, key = self_signed(tmp_path, "a")
    other_cert, _ = self_signed(tmp_path, "b")
    security = FrontDoorSecurity.load(RouterConfig(tls_cert_file=str(cert), tls_key_file=str(key)))
    assert security.tls and security.ssl_context() is not None and security.grpc_credentials() is not None
    with pytest.raises(ValueError, match="router.tls_cert_file / router.tls_key_file .*(mismatch|KEY_VALUES)"):
        FrontDoorSecurity.load(RouterConfig(tls_cert_file=str(other_cert), tls_key_file=str(key)))
    with pytest.raises(ValueError, match="No such file"):
        FrontDoorSecurity.load(RouterConfig(tls_cert_file=str(tmp_path / "none.pem"), tls_key_file=str(key)))


def test_relative_tls_paths_become_absolute(tmp_path, monkeypatch):
    self_signed(tmp_path)
    monkeypatch.chdir(tmp_path)
    security = FrontDoorSecurity.load(RouterConfig(tls_cert_file="router-cert.pem", tls_key_file="router-key.pem"))
    assert security.tls_cert_file == str(tmp_path / "router-cert.pem")


def test_a_spec_never_drops_a_configured_key_or_certificate():
    with pytest.raises(ValueError, match="asks for an API key but the spec carries none"):
        RouterSpec("m", "m", "colocated", (), "127.0.0.1:1", ClusterSecret.generate(), router=RouterConfig(api_key_env="K"))
    with pytest.raises(ValueError, match="asks for TLS but the spec carries no certificate"):
        RouterSpec("m", "m", "colocated", (), "127.0.0.1:1", ClusterSecret.generate(),
                   router=RouterConfig(tls_cert_file="c", tls_key_file="k"))


def flags(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["generate", "hi", "--address", "h:1", *argv])


def test_client_auth_order_flags_then_environment_then_yaml(tmp_path):
    cert, key = self_signed(tmp_path)
    (tmp_path / "flag-key").write_text("from-flag\n")
    cfg = load_with(tmp_path, api_key_env="ROUTER_KEY", tls_cert_file=str(cert), tls_key_file=str(key))
    env = {"ROUTER_KEY": "from-yaml-env"}
    assert client_auth(flags(), None, {}) == ClientAuth()
    from_yaml = client_auth(flags(), cfg, env)
    assert (from_yaml.api_key, from_yaml.tls, from_yaml.tls_ca_file) == ("from-yaml-env", True, str(cert))
    assert client_auth(flags(), cfg, {**env, "PDSERVE_API_KEY": "from-env"}).api_key == "from-env"
    chosen = client_auth(flags("--api-key-file", str(tmp_path / "flag-key"), "--tls-ca", "ca.pem"), cfg,
                         {**env, "PDSERVE_API_KEY": "from-env", "PDSERVE_TLS_CA": "env-ca.pem"})
    assert (chosen.api_key, chosen.tls_ca_file) == ("from-flag", "ca.pem")
    assert client_auth(flags("--tls"), None, {}) == ClientAuth(tls=True)
    assert client_auth(flags(), None, {"PDSERVE_TLS_CA": "env-ca.pem"}).tls_ca_file == "env-ca.pem"
    with pytest.raises(ValueError, match="--api-key-file: cannot read"):
        client_auth(flags("--api-key-file", str(tmp_path / "nope")), None, {})


def test_client_headers_metadata_and_urls():
    auth = ClientAuth(api_key=KEY, tls=True)
    assert auth.grpc_metadata() == (("authorization", f"Bearer {KEY}"),)
    assert auth.http_headers() == {"Authorization": f"Bearer {KEY}"}
    assert auth.base_url("127.0.0.1:8000") == "https://127.0.0.1:8000"
    assert ClientAuth().base_url("127.0.0.1:8000") == "http://127.0.0.1:8000" and ClientAuth().grpc_metadata() == ()
    with pytest.raises(ValueError, match="use https://"):
        auth.base_url("http://127.0.0.1:8000")


@pytest.mark.parametrize("command", [["generate", "x"], ["demo", "c.yaml"], ["bench"],
                                     ["bench", "compare", "a.yaml"]])
def test_every_client_command_has_the_security_flags(command, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--help"])
    out = capsys.readouterr().out
    assert "--api-key-file FILE" in out and "--tls-ca PEM" in out and "--tls " in out and "PDSERVE_API_KEY" in out


def test_metrics_targets_and_dry_run_follow_the_settings(tmp_path):
    cert, key = self_signed(tmp_path)
    cfg = load_with(tmp_path, http_port=8000, api_key_env="PDSERVE_API_KEY", tls_cert_file=str(cert),
                    tls_key_file=str(key))
    [router] = [t for t in metrics_targets(cfg) if t["labels"]["job"] == "pdserve-router"]
    assert router["labels"]["__scheme__"] == "https"
    assert "; TLS " + str(cert) + ", API key from env PDSERVE_API_KEY" in plan(cfg)[0]
    off = load_with(tmp_path, http_port=8000, http_metrics=False)
    assert not [t for t in metrics_targets(off) if t["labels"]["job"] == "pdserve-router"]
    assert "API key" not in plan(off)[0]
