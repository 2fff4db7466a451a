"""Who may call the router's public doors, and over what: the optional API key and TLS.

Resolved once from the YAML's router section (`FrontDoorSecurity.load`, run by cluster/specs.py
`router_spec` in the `pdserve up` process, so a missing variable or file fails before anything
starts) and carried to the router in its RouterSpec. The gRPC server (router/server.py) checks
the key in `ApiKeyInterceptor` before a request is read, the HTTP server (router/openai_http.py)
in a middleware before a body is read; both with `ApiKey.check`. Health checks stay open, so
load balancers and `pdserve up` need no key. The key never appears in a repr or a log line.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from configs.cluster import RouterConfig

OPEN_GRPC_PREFIX = "/grpc.health.v1.Health/"  # Check and Watch answer without a key
OPEN_HTTP_PATHS = frozenset({"/health"})


class ApiKey:
    """A bearer key and its check. Compared as SHA-256 digests with hmac.compare_digest, so the
    time taken tells a caller neither where its guess went wrong nor how long the key is."""

    def __init__(self, key: str) -> None:
        if not key or not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
            # It travels in an HTTP header / gRPC metadata value: printable ASCII, no spaces.
            raise ValueError("the API key must be non-empty printable ASCII without spaces")
        self._digest = hashlib.sha256(key.encode()).digest()

    def __repr__(self) -> str:
        return "ApiKey(****)"

    def check(self, authorization: str | None) -> str | None:
        """None when `authorization` (the header's / metadata's value) carries this key, else why not."""
        if authorization is None:
            return "missing API key: send 'Authorization: Bearer <key>' (gRPC metadata 'authorization')"
        scheme, _, presented = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            return "malformed Authorization: expected 'Bearer <key>'"
        if not hmac.compare_digest(hashlib.sha256(presented.strip().encode()).digest(), self._digest):
            return "wrong API key"
        return None


def read_api_key(cfg: RouterConfig, environ: Mapping[str, str] = os.environ) -> str | None:
    """The key `cfg` asks for, from the YAML, an environment variable or a file; None = no key.
    The router keeps only its digest (`load_api_key`); pdserve's own clients send it."""
    if cfg.api_key is not None:
        key, where = cfg.api_key.get_secret_value(), "router.api_key"
    elif cfg.api_key_env is not None:
        if not environ.get(cfg.api_key_env):
            raise ValueError(f"router.api_key_env: the environment variable {cfg.api_key_env} is not set (or empty)")
        key, where = environ[cfg.api_key_env].strip(), f"router.api_key_env ({cfg.api_key_env})"
    elif cfg.api_key_file is not None:
        try:
            key = Path(cfg.api_key_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"router.api_key_file: cannot read {cfg.api_key_file}: {exc}") from None
        where = f"router.api_key_file ({cfg.api_key_file})"
    else:
        return None
    try:
        ApiKey(key)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return key


def load_api_key(cfg: RouterConfig, environ: Mapping[str, str] = os.environ) -> ApiKey | None:
    key = read_api_key(cfg, environ)
    return None if key is None else ApiKey(key)


@dataclass(frozen=True)
class FrontDoorSecurity:
    """What both public doors demand. TLS files are absolute paths: the router reads them on the
    node of the `up` process that checked them, from whatever working directory it runs in."""

    api_key: ApiKey | None = field(default=None, repr=False)
    tls_cert_file: str | None = None
    tls_key_file: str | None = None

    @classmethod
    def load(cls, cfg: RouterConfig, environ: Mapping[str, str] = os.environ) -> FrontDoorSecurity:
        security = cls(load_api_key(cfg, environ),
                       *(str(Path(p).resolve()) if p else None for p in (cfg.tls_cert_file, cfg.tls_key_file)))
        security.ssl_context()  # a missing file or a key that does not match the certificate fails here
        return security

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None

    def ssl_context(self) -> ssl.SSLContext | None:
        """The HTTP door's TLS settings (Python's server defaults: TLS 1.2 or later); None = plain."""
        if self.tls_cert_file is None or self.tls_key_file is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"router.tls_cert_file / router.tls_key_file ({self.tls_cert_file}, "
                             f"{self.tls_key_file}): {exc}") from None
        return context

    def grpc_credentials(self) -> grpc.ServerCredentials | None:
        """The gRPC door's TLS credentials; None = plain (add_insecure_port)."""
        if self.tls_cert_file is None or self.tls_key_file is None:
            return None
        return grpc.ssl_server_credentials([(Path(self.tls_key_file).read_bytes(),
                                             Path(self.tls_cert_file).read_bytes())])


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a call without the key with UNAUTHENTICATED before its request is read: the
    refusing handler has no deserializer, so not a byte of the message is parsed."""

    def __init__(self, key: ApiKey, on_refused: Callable[[str, str], None]) -> None:
        self.key = key
        self.on_refused = on_refused  # (door, reason): counted and logged by the router

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_GRPC_PREFIX):
            return handler
        value = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        reason = self.key.check(value if isinstance(value, str) else None)
        if reason is None:
            return handler
        self.on_refused("grpc", reason)
        return _refusal(handler, reason)


def _refusal(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that answers UNAUTHENTICATED."""

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    async def refuse_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        yield  # never reached: makes this an async generator, as a streaming handler must be

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream)
    return grpc.unary_unary_rpc_method_handler(refuse)
