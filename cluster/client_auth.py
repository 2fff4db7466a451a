"""The API key and TLS settings `pdserve generate`, `demo`, `bench` and `bench compare` present
to a router: the `--api-key-file` / `--tls` / `--tls-ca` flags (cluster/cli.py `client_auth_args`)
first, then PDSERVE_API_KEY / PDSERVE_TLS_CA, then, for a cluster named by its YAML, what that
YAML's router asks for (the same key source; its certificate as the trusted one, which suits a
self-signed certificate). The result is a loadgen ClientAuth (loadgen/credentials.py)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path

from configs import ClusterConfig
from loadgen.credentials import API_KEY_ENV, TLS_CA_ENV, ClientAuth
from router.security import read_api_key


def add_client_auth_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "router security", f"for a router with an API key or TLS; the key comes from --api-key-file, else "
        f"${API_KEY_ENV}, else (with a cluster's YAML) the router's own setting")
    g.add_argument("--api-key-file", metavar="FILE",
                   help=f"file holding the API key (default: ${API_KEY_ENV}; never pass a key on the command line)")
    g.add_argument("--tls", action="store_true", help="dial with TLS, trusting the system's certificate authorities")
    g.add_argument("--tls-ca", metavar="PEM",
                   help=f"dial with TLS, trusting the certificates in PEM (default: ${TLS_CA_ENV}; with a "
                   "cluster's YAML, its router.tls_cert_file)")


def client_auth(args: argparse.Namespace, config: ClusterConfig | None = None,
                environ: Mapping[str, str] = os.environ) -> ClientAuth:
    """What to present; `config`: the YAML of the cluster being called, when the command knows it."""
    key = None
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"--api-key-file: cannot read {args.api_key_file}: {exc}") from None
    elif environ.get(API_KEY_ENV):
        key = environ[API_KEY_ENV].strip()
    elif config is not None and config.router.wants_api_key:
        key = read_api_key(config.router, environ)
    ca = args.tls_ca or environ.get(TLS_CA_ENV) or None
    tls = ca is not None or args.tls
    if not tls and config is not None and config.router.wants_tls:
        tls, ca = True, config.router.tls_cert_file
    return ClientAuth(api_key=key, tls=tls, tls_ca_file=ca)
