"""Where the cluster's secret comes from (proto/frame_auth.py signs every internal message with it).

The `up` process resolves it once, before anything starts (`resolve`), in this order:
1. `$PDSERVE_CLUSTER_SECRET` (an operator's, e.g. shared with processes started on other hosts);
2. the file named by the YAML's `cluster_secret_file` (the YAML holds the path, never the secret);
3. else a new one (`secrets.token_hex(32)`) for this `up` only.
It reaches the router and every worker inside their specs, which Ray hands to the actors as
constructor arguments (never an environment variable Ray shows, never a log line: its repr is
hidden). A generated one is also written, 0600, next to the `up` state file (`secret_file`) so that
`pdserve status` and `pdserve scale` of the same user can sign their control requests
(`for_client`); `up` removes it when it stops.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from cluster import launcher
from configs import ClusterConfig
from proto.frame_auth import ClusterSecret

ENV = "PDSERVE_CLUSTER_SECRET"


def resolve(config: ClusterConfig, environ: Mapping[str, str] = os.environ) -> tuple[ClusterSecret, bool]:
    """(the secret, whether it was generated now) for a cluster `up` starts."""
    given = given_secret(config, environ)
    return (given, False) if given is not None else (ClusterSecret.generate(), True)


def given_secret(config: ClusterConfig, environ: Mapping[str, str] = os.environ) -> ClusterSecret | None:
    """The operator's secret ($PDSERVE_CLUSTER_SECRET, else `cluster_secret_file`); None = none
    given. A variable or file that is there but unusable is an error, never a silent new secret."""
    if environ.get(ENV):
        try:
            return ClusterSecret(environ[ENV])
        except ValueError as exc:
            raise ValueError(f"${ENV}: {exc}") from None
    if config.cluster_secret_file is not None:
        path = Path(config.cluster_secret_file).expanduser()
        try:
            return ClusterSecret(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"cluster_secret_file ({path}): {exc}") from None
    return None


def secret_file(config_path: str | Path) -> Path:
    """Where `up` keeps a generated secret for its clients: beside its state file, owner-only."""
    return launcher.state_file(config_path).with_suffix(".secret")


def write_secret_file(config_path: str | Path, secret: ClusterSecret) -> Path:
    path = secret_file(config_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # a new file gets the mode below; an existing one would keep its own
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.reveal())
    return path


def for_client(config: ClusterConfig, config_path: str | Path,
               environ: Mapping[str, str] = os.environ) -> ClusterSecret:
    """The secret `pdserve status` / `scale` sign with: the operator's, else the one the running
    `up` generated (its file)."""
    given = given_secret(config, environ)
    if given is not None:
        return given
    path = secret_file(config_path)
    try:
        return ClusterSecret(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"no cluster secret: set ${ENV} or cluster_secret_file, or run this as the user whose "
                         f"`pdserve up` wrote {path} ({exc})") from None
