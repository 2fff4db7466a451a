"""Where the cluster's secret comes from (cluster/cluster_secret.py): the operator's variable,
else the YAML's file, else a new one; an unusable one is an error, never a silent new secret;
a generated one is written owner-only for `status` / `scale` and found by them."""

from __future__ import annotations

import stat

import pytest

from cluster import cluster_secret
from cluster.launcher import RUN_DIR_ENV
from configs import ClusterConfig
from proto.frame_auth import ClusterSecret

GIVEN = "an-operators-secret-0123456789"


def config(**extra) -> ClusterConfig:
    return ClusterConfig.model_validate({"model": "builtin:tiny", "mode": "colocated",
                                         "colocated": {"base_port": 52100}, **extra})


def test_the_variable_wins_then_the_file_then_a_new_one(tmp_path):
    path = tmp_path / "secret"
    path.write_text("from-the-file-0123456789\n")
    with_file = config(cluster_secret_file=str(path))
    assert cluster_secret.resolve(with_file, {cluster_secret.ENV: GIVEN}) == (ClusterSecret(GIVEN), False)
    assert cluster_secret.resolve(with_file, {}) == (ClusterSecret("from-the-file-0123456789"), False)
    first, generated = cluster_secret.resolve(config(), {})
    assert generated and first != cluster_secret.resolve(config(), {})[0]


@pytest.mark.parametrize(("environ", "file_text", "message"), [
    ({cluster_secret.ENV: "short"}, None, "PDSERVE_CLUSTER_SECRET"),
    ({}, "has spaces in the middle", "cluster_secret_file"),
    ({}, None, "cluster_secret_file"),  # named but missing
])
def test_an_unusable_secret_is_an_error(tmp_path, environ, file_text, message):
    path = tmp_path / "secret"
    if file_text is not None:
        path.write_text(file_text)
    with pytest.raises(ValueError, match=message):
        cluster_secret.resolve(config(cluster_secret_file=str(path)), environ)


def test_a_generated_secret_reaches_status_and_scale_through_an_owner_only_file(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "run"))
    yaml_path = tmp_path / "cluster.yaml"
    with pytest.raises(ValueError, match="no cluster secret"):
        cluster_secret.for_client(config(), yaml_path, {})
    secret = ClusterSecret.generate()
    path = cluster_secret.write_secret_file(yaml_path, secret)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert cluster_secret.for_client(config(), yaml_path, {}) == secret
    assert cluster_secret.for_client(config(), yaml_path, {cluster_secret.ENV: GIVEN}) == ClusterSecret(GIVEN)
