"""An OpenAI-style HTTP request body -> the GenerateRequest the gRPC service takes.

Used by router/openai_http.py before `Router.run`: it reads the body (JSON only, size-bounded),
checks the OpenAI-level fields (model, n, types of the numbers, prompt shape, logprobs) and
fills a GenerateRequest; the limits shared with gRPC (prompt bytes, stop strings, stop token
ids, vocabulary, context) are then checked once, by router/validation.py, for both doors.
Every refusal here is a `BadRequest` naming the field and the HTTP status it is answered with.
"""

from __future__ import annotations

import json

import jinja2
from aiohttp import web

from configs.engine import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS
from proto import pdserve_pb2 as pb

# JSON escapes can spell one byte of prompt as six ("\u0001"); a body may also carry stop
# strings, a token-id prompt and the rest, so it may be this much larger than the prompt bound.
JSON_BYTES_PER_PROMPT_BYTE = 6
BODY_OVERHEAD_BYTES = 1 << 20
JSON_TYPES = ("application/json",)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


def max_body_bytes(max_prompt_bytes: int) -> int:
    """The largest body the HTTP door reads: room for a prompt at router.max_prompt_bytes, however escaped."""
    return JSON_BYTES_PER_PROMPT_BYTE * max_prompt_bytes + BODY_OVERHEAD_BYTES


async def read_body(request: web.Request, max_bytes: int) -> dict:
    """The request's JSON object. A body that says it is something else is 415 (no Content-Type is
    taken as JSON); one over `max_bytes` (the app's client_max_size) is 413 naming the bound."""
    content_type = request.headers.get("Content-Type")
    if content_type is not None and request.content_type not in JSON_TYPES and not request.content_type.endswith("+json"):
        raise BadRequest(f"Content-Type {request.content_type!r} is not supported: send application/json",
                         "Content-Type", status=415)
    try:
        text = await request.text()
    except web.HTTPRequestEntityTooLarge:
        raise BadRequest(f"the request body is over {max_bytes} bytes "
                         "(6 x router.max_prompt_bytes + 1 MiB)", status=413) from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def to_grpc(body: dict, chat: bool, model_name: str, chat_template: jinja2.Template) -> pb.GenerateRequest:
    """The GenerateRequest for an OpenAI completions (or, `chat`, chat completions) body."""
    if body.get("n", 1) != 1:
        raise BadRequest("only n=1 is supported", "n")
    if body.get("model") not in (None, model_name):
        raise BadRequest(f"model {body.get('model')!r} is not served here; use {model_name!r}", "model")
    req = pb.GenerateRequest()
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
            raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
        req.text = chat_template.render(messages=messages, add_generation_prompt=True)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            req.text = prompt
        elif isinstance(prompt, list) and all(_token_id(t) for t in prompt):
            req.token_ids.ids.extend(prompt)
        else:
            raise BadRequest("prompt must be a string or a list of token ids (one prompt per request)", "prompt")
    s = req.sampling
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    for name, value, kind in (("max_tokens", max_tokens, int), ("temperature", body.get("temperature"), float),
                              ("top_p", body.get("top_p"), float), ("top_k", body.get("top_k"), int),
                              ("seed", body.get("seed"), int)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
            raise BadRequest(f"{name} must be a number", name)
        if kind is int and value < 0:
            raise BadRequest(f"{name} must be >= 0", name)
        try:
            setattr(s, name, value)
        except ValueError:  # past the field's wire type (uint32 / uint64): say which field
            raise BadRequest(f"{name} is out of range: {value}", name) from None
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
            raise BadRequest("stop must be a string or a list of strings", "stop")
        s.stop.extend(stops)
    stop_token_ids = body.get("stop_token_ids")  # vLLM's extra parameter; limits as over gRPC
    if stop_token_ids is not None:
        if not isinstance(stop_token_ids, list) or not all(_token_id(t) for t in stop_token_ids):
            raise BadRequest("stop_token_ids must be a list of token ids", "stop_token_ids")
        s.stop_token_ids.extend(stop_token_ids)
    _speculative(body, s)
    s.ignore_eos = bool(body.get("ignore_eos", False))
    s.logprobs = _wants_logprobs(body, chat)
    return req


def _speculative(body: dict, s: pb.SamplingParams) -> None:
    """pdserve's extension fields: speculative_method ("none", "prompt_lookup", "draft", "medusa",
    "prompt_lookup+draft") and num_speculative_tokens (0-16); absent, the serving pool's setting applies."""
    method, num = body.get("speculative_method"), body.get("num_speculative_tokens")
    if method is not None:
        if method not in SPECULATIVE_METHODS:
            raise BadRequest(f"speculative_method must be one of {', '.join(map(repr, SPECULATIVE_METHODS))}",
                             "speculative_method")
        s.speculative_method = method
    if num is not None:
        if isinstance(num, bool) or not isinstance(num, int) or not 0 <= num <= MAX_SPECULATIVE_TOKENS:
            raise BadRequest(f"num_speculative_tokens must be an integer in [0, {MAX_SPECULATIVE_TOKENS}]",
                             "num_speculative_tokens")
        s.num_speculative_tokens = num


def _token_id(value: object) -> bool:
    """A token id as the wire can carry it (uint32); whether the model has it is checked later."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 32


def _wants_logprobs(body: dict, chat: bool) -> bool:
    """Chat: `logprobs: true` (`top_logprobs` 0); completions: `logprobs: 0`. The chosen tokens'
    log-probabilities come back; top alternatives are refused, not silently dropped."""
    if chat:
        wanted, top, name = body.get("logprobs"), body.get("top_logprobs"), "top_logprobs"
        if wanted not in (None, True, False):
            raise BadRequest("logprobs must be a boolean", "logprobs")
    else:
        top, name = body.get("logprobs"), "logprobs"
        wanted = top is not None
    if top not in (None, 0) or isinstance(top, bool):
        raise BadRequest(f"{name} alternatives are not supported: ask for {name}: 0 (the chosen tokens' "
                         "log-probabilities only)", name)
    return bool(wanted)
