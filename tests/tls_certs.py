"""Self-signed TLS certificates made for a test, with the `openssl` command line (the venv has
no `cryptography`): an EC P-256 key and a one-day certificate naming 127.0.0.1 and localhost,
so a client that trusts the certificate can dial the router by its loopback address."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def self_signed(directory: Path, name: str = "router") -> tuple[Path, Path]:
    """(certificate, private key) PEM files written into `directory`."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command line to make a test certificate")
    cert, key = directory / f"{name}-cert.pem", directory / f"{name}-key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "1", "-subj", f"/CN=pdserve-test-{name}",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=30)
    return cert, key
