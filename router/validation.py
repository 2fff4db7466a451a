"""GenerateRequest -> a validated Journey, or INVALID_ARGUMENT with what is wrong.

First thing the router does with a request: nothing reaches a worker until this passed, so a
worker never sees a request it must reject for its shape.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, fields

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from configs.cluster import RouterConfig
from configs.engine import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS
from proto import pdserve_pb2 as pb
from proto import worker_messages as wm
from router.journey_state import Journey, RouterError
from router.request_ids import new_client_id, new_internal_id
from router.tokenizer import RouterTokenizer


def _invalid(message: str) -> RouterError:
    return RouterError(grpc.StatusCode.INVALID_ARGUMENT, message)


class UndecodableRequest:
    """Stands in for a request the protobuf parser refused (e.g. a string that is not UTF-8),
    so the client gets INVALID_ARGUMENT with the reason rather than gRPC's generic INTERNAL."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def deserialize_request(data: bytes) -> pb.GenerateRequest | UndecodableRequest:
    try:
        return pb.GenerateRequest.FromString(data)
    except DecodeError as exc:
        return UndecodableRequest(str(exc))


@dataclass(frozen=True)
class RequestLimits:
    """The router's bounds on one request (router.max_* in the YAML): checked before any work,
    so no request costs more than they allow (a prompt is measured before it is tokenized)."""

    max_prompt_bytes: int = 1 << 20
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 64
    max_request_id_chars: int = 128
    max_timeout_s: float = 3600.0

    @classmethod
    def of(cls, router: RouterConfig) -> RequestLimits:
        return cls(**{f.name: getattr(router, f.name) for f in fields(cls)})


REQUEST_ID = re.compile(r"[\x21-\x7e]+")  # printable ASCII without spaces: safe in logs and messages


def validate(request: pb.GenerateRequest | UndecodableRequest, tokenizer: RouterTokenizer, max_model_len: int,
             default_timeout_s: float, now: float | None = None, limits: RequestLimits = RequestLimits()) -> Journey:
    if isinstance(request, UndecodableRequest):
        raise _invalid(f"the request is not a valid GenerateRequest ({request.reason}; strings must be UTF-8)")
    check_request_id(request.request_id, limits)
    for name, message in (("request", request), ("sampling", request.sampling), ("token_ids", request.token_ids)):
        unknown = sorted({field.field_number for field in UnknownFieldSet(message)})
        if unknown:
            raise _invalid(f"unknown fields {unknown} in {name}: is the client built from another pdserve.proto?")
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise _invalid("prompt is missing: set 'text' or 'token_ids'")
    if kind == "text":
        if not request.text:
            raise _invalid("prompt text is empty")
        if len(request.text) > limits.max_prompt_bytes or len(request.text.encode()) > limits.max_prompt_bytes:
            raise _invalid(f"prompt text is over router.max_prompt_bytes ({limits.max_prompt_bytes} bytes)")
        ids = tokenizer.encode(request.text)
    else:
        ids = list(request.token_ids.ids)
        if not ids:
            raise _invalid("prompt token_ids is empty")
        bad = [t for t in ids if t >= tokenizer.vocab_size]
        if bad:
            raise _invalid(f"token ids outside [0, {tokenizer.vocab_size}): {bad[:5]}")
    if len(ids) >= max_model_len:
        raise _invalid(f"prompt has {len(ids)} tokens; the model's context is {max_model_len} tokens")
    s = request.sampling
    max_tokens = s.max_tokens if s.HasField("max_tokens") else 16
    if max_tokens < 1:
        raise _invalid("sampling.max_tokens must be >= 1")
    temperature = s.temperature if s.HasField("temperature") else 0.0
    if not math.isfinite(temperature) or temperature < 0:
        raise _invalid(f"sampling.temperature must be a finite number >= 0, got {temperature}")
    top_p = s.top_p if s.HasField("top_p") else 1.0
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise _invalid(f"sampling.top_p must be in (0, 1], got {top_p}")
    if len(s.stop_token_ids) > limits.max_stop_token_ids:
        raise _invalid(f"{len(s.stop_token_ids)} stop token ids: over router.max_stop_token_ids "
                       f"({limits.max_stop_token_ids})")
    if len(s.stop) > limits.max_stop_strings:
        raise _invalid(f"{len(s.stop)} stop strings: over router.max_stop_strings ({limits.max_stop_strings})")
    if any(len(stop) > limits.max_stop_string_chars for stop in s.stop):
        raise _invalid(f"a stop string is over router.max_stop_string_chars ({limits.max_stop_string_chars})")
    bad_stops = [t for t in s.stop_token_ids if t >= tokenizer.vocab_size]
    if bad_stops:
        raise _invalid(f"sampling.stop_token_ids outside the vocabulary: {bad_stops[:5]}")
    if any(not stop for stop in s.stop):
        raise _invalid("sampling.stop strings must be non-empty")
    method = s.speculative_method if s.HasField("speculative_method") else None
    if method is not None and method not in SPECULATIVE_METHODS:
        raise _invalid(f"sampling.speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}")
    num_spec = s.num_speculative_tokens if s.HasField("num_speculative_tokens") else None
    if num_spec is not None and num_spec > MAX_SPECULATIVE_TOKENS:
        raise _invalid(f"sampling.num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], got {num_spec}")
    if not math.isfinite(request.timeout_s) or not 0 <= request.timeout_s <= limits.max_timeout_s:
        raise _invalid(f"timeout_s must be in [0, {limits.max_timeout_s:g}] (router.max_timeout_s), "
                       f"got {request.timeout_s}")
    sampling = wm.Sampling(
        max_tokens=min(max_tokens, max_model_len - len(ids)), temperature=float(temperature),
        top_k=s.top_k if s.HasField("top_k") else 0, top_p=float(top_p),
        seed=s.seed if s.HasField("seed") else None, stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos, logprobs=s.logprobs, speculative_method=method, num_speculative_tokens=num_spec,
    )
    timeout = request.timeout_s or default_timeout_s
    start = time.monotonic() if now is None else now
    # A fresh internal id; Router.run, which logged the request under one at arrival, puts its own.
    return Journey(new_internal_id(), request.request_id or new_client_id(), tuple(ids), sampling, tuple(s.stop),
                   start + timeout)


def check_request_id(request_id: str, limits: RequestLimits) -> None:
    """A client's request id (empty: the router makes one) is echoed in its responses and logged:
    bounded, printable, no spaces or control characters. Workers never see it (router/request_ids.py)."""
    if request_id and (len(request_id) > limits.max_request_id_chars or not REQUEST_ID.fullmatch(request_id)):
        raise _invalid(f"request_id must be 1-{limits.max_request_id_chars} printable ASCII characters without "
                       "spaces (router.max_request_id_chars)")
