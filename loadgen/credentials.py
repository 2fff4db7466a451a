"""What a pdserve client presents to a router that asks for an API key or serves TLS.

One frozen `ClientAuth` per client, built by the CLI (cluster/client_auth.py: flags, then the
environment, then the cluster's YAML) and handed to whatever dials the router: `pdserve generate`
and `demo` (cluster/cmd_requests.py), the bench backends (loadgen/client.py). It makes the
gRPC channel (TLS or plain), the `authorization` metadata each call carries, the HTTP headers
and the SSL context for aiohttp. The key never appears in its repr.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path

import grpc

API_KEY_ENV = "PDSERVE_API_KEY"  # the key clients send, when no flag names one
TLS_CA_ENV = "PDSERVE_TLS_CA"  # PEM file of the certificates clients trust, when no flag names one


@dataclass(frozen=True)
class ClientAuth:
    api_key: str | None = field(default=None, repr=False)
    tls: bool = False  # dial with TLS; trust tls_ca_file, or the system's roots when it is None
    tls_ca_file: str | None = None

    def __post_init__(self) -> None:
        if self.tls_ca_file is not None and not self.tls:
            raise ValueError("tls_ca_file without tls: a trusted certificate only matters over TLS")

    def grpc_metadata(self) -> tuple[tuple[str, str], ...]:
        """Per-call metadata (sent on plain channels too: a loopback router may ask for a key without TLS)."""
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    def http_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _root_certificates(self) -> bytes | None:
        if self.tls_ca_file is None:
            return None
        try:
            return Path(self.tls_ca_file).read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read the trusted certificate file {self.tls_ca_file}: {exc}") from None

    def grpc_channel(self, address: str, options=()) -> grpc.Channel:
        if not self.tls:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(self._root_certificates()), options=options)

    def grpc_aio_channel(self, address: str, options=()) -> grpc.aio.Channel:
        if not self.tls:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(self._root_certificates()),
                                       options=options)

    def ssl_context(self) -> ssl.SSLContext | None:
        """For aiohttp's connector: None = its defaults (system roots for an https:// URL)."""
        if self.tls_ca_file is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        try:
            context.load_verify_locations(cafile=self.tls_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load the trusted certificate file {self.tls_ca_file}: {exc}") from None
        return context

    def base_url(self, address: str) -> str:
        """An HTTP base URL for `address` (HOST:PORT or a URL): https:// with TLS, http:// without."""
        scheme = "https" if self.tls else "http"
        if "://" not in address:
            return f"{scheme}://{address}"
        if self.tls and address.startswith("http://"):
            raise ValueError(f"TLS was asked for (--tls/--tls-ca) but the address is {address}: use https://")
        return address


NO_AUTH = ClientAuth()  # a plain channel, no key: an open router on a trusted network
