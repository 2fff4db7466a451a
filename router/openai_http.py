"""The OpenAI-compatible HTTP front door: /v1/completions, /v1/chat/completions (JSON or
server-sent events), /v1/models, /health and the router's Prometheus /metrics (optional), served
by the router beside gRPC, behind the same optional API key and TLS (router/security.py).

Each request is translated into the same GenerateRequest the gRPC service takes and runs
through `Router.run` (validation, admission, journey), so both doors behave alike. Errors use
OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the matching HTTP
status. Chat prompts are rendered with the model's chat template (tokenizer_config.json), or
with DEFAULT_CHAT_TEMPLATE when it has none.

Request ids, as vLLM's server does: the client's `X-Request-Id` header (or a fresh id) is the
request's client id, echoed in the `X-Request-Id` response header and logged by the router; the
body's `id` is `cmpl-<client id>` / `chatcmpl-<client id>`. A second live request under the same
header is 409. Workers never see it: the router names the request with its own internal id
(router/request_ids.py).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import grpc
import jinja2.sandbox
from aiohttp import web

from proto import pdserve_pb2 as pb
from proto.usage_stages import usage_stages
from router.journey_state import RouterError
from router.openai_request import BadRequest, max_body_bytes, read_body, to_grpc
from router.request_ids import new_client_id
from router.security import OPEN_HTTP_PATHS
from router.server import Router
from router.slo_admission import SloRefused
from router.validation import check_request_id

# Used when the model ships no chat template: one line per turn, then the assistant's cue.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
REQUEST_ID_HEADER = "X-Request-Id"
FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


def error_response(status: int, message: str, kind: str, param: str | None = None,
                   code: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code}},
                             status=status)


def router_error_response(exc: RouterError) -> web.Response:
    """The router's error as OpenAI's error body and HTTP status; a refusal that says when to
    come back (router/slo_admission.py) sets Retry-After."""
    status, kind = HTTP_STATUS.get(exc.code, (500, "internal_error"))
    response = error_response(status, str(exc), kind)
    if isinstance(exc, SloRefused):
        response.headers["Retry-After"] = str(exc.retry_after_s)
    return response


class OpenAIServer:
    def __init__(self, router: Router, model_dir: str | Path, model_name: str) -> None:
        self.router = router
        self.model_name = model_name
        config_path = Path(model_dir) / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = config.get("chat_template") or DEFAULT_CHAT_TEMPLATE
        self.chat_template = jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(template)
        self.security = router.spec.security
        self.max_body_bytes = max_body_bytes(router.limits.max_prompt_bytes)
        self.app = web.Application(middlewares=[self._check_key] if self.security.api_key else [],
                                   client_max_size=self.max_body_bytes)
        self.app.add_routes([
            web.get("/health", self.health), web.get("/v1/models", self.models),
            web.post("/v1/completions", self.completions), web.post("/v1/chat/completions", self.chat),
        ])
        if router.spec.router.http_metrics:
            self.app.add_routes([web.get("/metrics", self.metrics)])
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> int:
        # handler_cancellation: a client that disconnects cancels its handler, which closes the
        # request's journey and aborts it on every worker (streaming or not).
        self._runner = web.AppRunner(self.app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=self.security.ssl_context())
        await site.start()
        return site._server.sockets[0].getsockname()[1]  # the bound port (port 0 picks one)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _check_key(self, request: web.Request, handler) -> web.StreamResponse:
        """Every path but /health asks for the key, checked before the body is read."""
        if request.path in OPEN_HTTP_PATHS:
            return await handler(request)
        reason = self.security.api_key.check(request.headers.get("Authorization"))
        if reason is None:
            return await handler(request)
        self.router.refused("http", reason)
        response = error_response(401, reason, "invalid_request_error", code="invalid_api_key")
        response.headers["WWW-Authenticate"] = "Bearer"  # RFC 6750: the scheme the client should use
        return response

    async def health(self, request: web.Request) -> web.Response:
        ready = self.router.is_ready()
        return web.json_response({"status": "ok" if ready else "unavailable"}, status=200 if ready else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.router.metrics.exposition(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "pdserve"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await read_body(request, self.max_body_bytes)
            grpc_request = to_grpc(body, chat, self.model_name, self.chat_template)
        except BadRequest as exc:
            return error_response(exc.status, str(exc), "invalid_request_error", exc.param)
        except (ValueError, TypeError) as exc:  # not JSON (json.JSONDecodeError), not UTF-8, ...
            return error_response(400, str(exc), "invalid_request_error")
        client_id = request.headers.get(REQUEST_ID_HEADER) or new_client_id()
        try:
            check_request_id(client_id, self.router.limits)
        except RouterError as exc:
            return error_response(400, f"{REQUEST_ID_HEADER}: {exc}", "invalid_request_error", REQUEST_ID_HEADER)
        grpc_request.request_id = client_id  # echoed and logged by the router, never sent to a worker
        rid = ("chatcmpl-" if chat else "cmpl-") + client_id
        created = int(time.time())
        stream = bool(body.get("stream"))
        # aclosing: however this handler ends (done, error, the client gone), the journey is closed
        # now, which aborts the request on every worker and frees its pages.
        async with contextlib.aclosing(self.router.run(grpc_request)) as responses:
            response = await self._respond(request, responses, rid, client_id, created, chat, stream)
        if not response.prepared:  # a streamed response sent its headers already, this one with them
            response.headers[REQUEST_ID_HEADER] = client_id
        return response

    async def _respond(self, request: web.Request, responses, rid: str, client_id: str, created: int, chat: bool,
                       stream: bool) -> web.StreamResponse:
        try:
            first = await anext(responses)  # errors before anything was sent become HTTP errors
        except RouterError as exc:
            return router_error_response(exc)
        if not stream:
            text, ids, logprobs, last = [first.text], list(first.token_ids), list(first.logprobs), first
            try:
                async for r in responses:
                    text.append(r.text)
                    ids += r.token_ids
                    logprobs += r.logprobs
                    last = r
            except RouterError as exc:  # after the first token: still an OpenAI-shaped error
                return router_error_response(exc)
            return web.json_response(self._body(rid, created, chat, "".join(text), FINISH.get(last.finish_reason),
                                                last.usage, final=True, stream=False,
                                                logprobs=self._logprobs(chat, ids, logprobs)))
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                          REQUEST_ID_HEADER: client_id})
        await out.prepare(request)
        try:
            await self._stream(out, first, responses, rid, created, chat)
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
        except ConnectionResetError:
            # The client left between two writes, before aiohttp cancelled this handler (aiohttp's
            # ClientConnectionResetError): not a server error, so no traceback. The caller's
            # aclosing ends the journey, which aborts the request on every worker (CANCELLED).
            pass
        return out

    async def _stream(self, out: web.StreamResponse, first, responses, rid: str, created: int, chat: bool) -> None:
        """Server-sent events, one per response with something to say; an error after the first
        token is an OpenAI-shaped error event."""
        try:
            if chat:  # OpenAI streams the role first
                await self._event(out, self._body(rid, created, chat, None, None, None, final=False, stream=True))
            response, offset = first, 0
            while True:
                done = response.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                if response.text or done or response.logprobs:  # a token held back as text still has its logprob
                    lps = self._logprobs(chat, response.token_ids, response.logprobs, offset)
                    await self._event(out, self._body(rid, created, chat, response.text, FINISH.get(response.finish_reason),
                                                      response.usage if done else None, final=done, stream=True,
                                                      logprobs=lps))
                    offset += len(response.text)
                if done:
                    break
                response = await anext(responses)
        except RouterError as exc:
            status, kind = HTTP_STATUS.get(exc.code, (500, "internal_error"))
            await self._event(out, {"error": {"message": str(exc), "type": kind, "param": None, "code": status}})

    def _logprobs(self, chat: bool, token_ids, logprobs, offset: int = 0) -> dict | None:
        """OpenAI's logprobs object for these tokens (None when the request did not ask): the
        chosen tokens only; `offset` is where the first token's text starts in the completion."""
        if not logprobs:
            return None
        tokens = [self.router.tokenizer.decode([t]) for t in token_ids]
        if chat:
            return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                                for s, lp in zip(tokens, logprobs)]}
        offsets = [offset + sum(len(s) for s in tokens[:i]) for i in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None, "text_offset": offsets}

    async def _event(self, out: web.StreamResponse, payload: dict) -> None:
        await out.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

    def _body(self, rid: str, created: int, chat: bool, text: str | None, finish: str | None, usage, final: bool,
              stream: bool, logprobs: dict | None = None) -> dict:
        if chat:
            if stream:
                delta = {"role": "assistant"} if text is None else {"content": text}
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            choice["logprobs"] = logprobs
            kind = "chat.completion.chunk" if stream else "chat.completion"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
            kind = "text_completion"
        body = {"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": [choice]}
        if final and usage is not None:
            body["usage"] = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                             "total_tokens": usage.prompt_tokens + usage.completion_tokens}
            body["usage"].update(usage_stages(usage))  # pdserve's extension: where the TTFT went, the KV hand-off
            if usage.spec_proposed_tokens:  # pdserve's extension: the request's speculative decoding
                body["usage"]["spec_proposed_tokens"] = usage.spec_proposed_tokens
                body["usage"]["spec_accepted_tokens"] = usage.spec_accepted_tokens
        return body
