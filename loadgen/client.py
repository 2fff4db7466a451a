"""The two ways `pdserve bench` talks to a server: pdserve's gRPC `Generate`, or any
OpenAI-compatible `/v1/completions` over server-sent events (so peers can be measured too).

Second step of a bench run (loadgen/runner.py): each BenchRequest is sent by a backend, which
timestamps every streamed chunk that carries output as it arrives and returns a
RequestRecord (loadgen/metrics.py computes TTFT/TPOT/ITL/E2E from those times). Both
backends stamp the same moment: when a chunk with new output has been read off the socket.
Prompts go as token ids and every request sets `ignore_eos`, so output lengths are exact;
RequestOptions adds what else every request asks for (speculative decoding). A secured router
gets the API key and TLS settings of a ClientAuth (loadgen/credentials.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Self

import aiohttp
import grpc

from loadgen.credentials import API_KEY_ENV, NO_AUTH, ClientAuth
from loadgen.metrics import RequestRecord
from loadgen.workloads import BenchRequest
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc
from proto.usage_stages import request_stages, usage_stages

REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RequestOptions:
    """Per-request settings every bench request carries: gRPC SamplingParams fields, or the same
    names as extension fields of the OpenAI body (pdserve's; other servers may refuse them).
    None: not sent, the server's setting applies."""

    speculative_method: str | None = None  # configs.engine.SPECULATIVE_METHODS
    num_speculative_tokens: int | None = None

    def body_fields(self) -> dict:
        return {k: v for k, v in (("speculative_method", self.speculative_method),
                                  ("num_speculative_tokens", self.num_speculative_tokens)) if v is not None}


NO_OPTIONS = RequestOptions()


class BaseBackend:
    """Sends bench requests to one server. Use as `async with backend:` and call `send` from
    any number of concurrent tasks inside it; `send` never raises for a failed request, it
    returns a record with ok=False and the error's name."""

    name = "base"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        return None

    async def send(self, request: BenchRequest, arrival: float) -> RequestRecord:
        raise NotImplementedError


class GrpcBackend(BaseBackend):
    """pdserve's router: streaming `Generate`, one response per batch of new token ids."""

    name = "grpc"

    def __init__(self, address: str, model: str | None = None, auth: ClientAuth = NO_AUTH,
                 options: RequestOptions = NO_OPTIONS) -> None:
        self.address = address
        self.auth = auth
        self.options = options
        self._channel: grpc.aio.Channel | None = None

    async def __aenter__(self) -> Self:
        self._channel = self.auth.grpc_aio_channel(self.address)
        self._stub = pdserve_pb2_grpc.GenerationStub(self._channel)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._channel.close()

    async def send(self, request: BenchRequest, arrival: float) -> RequestRecord:
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=request.prompt),
                                 sampling=pb.SamplingParams(max_tokens=request.output_len, ignore_eos=True,
                                                            **self.options.body_fields()))
        times, n, stages = [], 0, {}
        try:
            async for resp in self._stub.Generate(req, timeout=REQUEST_TIMEOUT_S, metadata=self.auth.grpc_metadata()):
                if resp.token_ids:
                    times.append(time.perf_counter())
                    n += len(resp.token_ids)
                if resp.HasField("usage"):  # the last message
                    stages = request_stages(usage_stages(resp.usage))
        except grpc.aio.AioRpcError as exc:
            return RequestRecord(arrival, tuple(times), n, len(request.prompt), ok=False, error=exc.code().name,
                                 kind=request.kind)
        return RequestRecord(arrival, tuple(times), n, len(request.prompt), kind=request.kind, stages=stages)


class OpenAIBackend(BaseBackend):
    """Any OpenAI-compatible server: POST {base_url}/v1/completions with `stream: true`.

    Chunks carry text, not token counts, so the number of output tokens comes from the usage
    in the final chunk (`stream_options.include_usage`); a server that sends none is counted
    one token per chunk. A chunk is stamped when its text is non-empty or it finishes the
    request: a detokenizer may hold back a last token that only completes a character, and
    the request is not done until the finishing chunk arrives.
    """

    name = "openai"

    def __init__(self, address: str, model: str | None = None, auth: ClientAuth = NO_AUTH,
                 options: RequestOptions = NO_OPTIONS) -> None:
        self.base_url = auth.base_url(address).rstrip("/").removesuffix("/v1")
        self.model = model
        self.auth = auth
        self.options = options
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        # limit=0: no client-side connection pool cap, or requests would queue here unmeasured.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ssl=self.auth.ssl_context() or True),
            headers=self.auth.http_headers(), timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))
        if self.model is None:  # the server's first model, as peer benchmark tools do
            try:
                async with self._session.get(f"{self.base_url}/v1/models") as resp:
                    if resp.status in (401, 403):
                        await self._session.close()
                        raise RuntimeError(f"{self.base_url} refused the API key (HTTP {resp.status}): give it with "
                                           f"${API_KEY_ENV} or --api-key-file")
                    resp.raise_for_status()
                    self.model = (await resp.json())["data"][0]["id"]
            except (aiohttp.ClientError, TimeoutError, KeyError, IndexError) as exc:
                await self._session.close()
                raise RuntimeError(f"no model list at {self.base_url}/v1/models ({exc!r}); is the server "
                                   f"up? (--model NAME skips this lookup)") from None
        return self

    async def __aexit__(self, *exc) -> None:
        await self._session.close()

    async def send(self, request: BenchRequest, arrival: float) -> RequestRecord:
        body = {"model": self.model, "prompt": list(request.prompt), "max_tokens": request.output_len,
                "temperature": 0.0, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}, **self.options.body_fields()}
        times, usage_tokens, error, stages = [], None, "", {}
        try:
            async with self._session.post(f"{self.base_url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    error = f"HTTP {resp.status}"
                else:
                    async for line in resp.content:
                        now = time.perf_counter()
                        data = line.decode().strip().removeprefix("data:").strip()
                        if not line.startswith(b"data:") or data == "[DONE]":
                            continue
                        chunk = json.loads(data)
                        if "error" in chunk:
                            error = chunk["error"].get("type") or "error"
                            break
                        if chunk.get("usage"):
                            usage_tokens = chunk["usage"]["completion_tokens"]
                            stages = request_stages(chunk["usage"])  # pdserve's extension; {} elsewhere
                        choice = (chunk.get("choices") or [{}])[0]
                        if choice.get("text") or choice.get("finish_reason"):
                            times.append(now)
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
            error = type(exc).__name__
        n = usage_tokens if usage_tokens is not None else len(times)
        return RequestRecord(arrival, tuple(times), n, len(request.prompt), ok=not error, error=error,
                             kind=request.kind, stages=stages)


BACKENDS: dict[str, type[BaseBackend]] = {"grpc": GrpcBackend, "openai": OpenAIBackend}


def make_backend(kind: str, address: str, model: str | None = None, auth: ClientAuth = NO_AUTH,
                 options: RequestOptions = NO_OPTIONS) -> BaseBackend:
    if kind not in BACKENDS:
        raise ValueError(f"unknown backend {kind!r}; choose one of {tuple(BACKENDS)}")
    return BACKENDS[kind](address, model, auth, options)
