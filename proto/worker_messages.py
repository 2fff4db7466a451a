"""Router <-> worker messages (ZMQ, msgpack): plain frozen dataclasses, no pickle.

The disaggregated journey of request R (docs/design.md §2), one message per arrow:
    router -> decode   ReserveKV(R, prompt, lease, sampling)   pages first: backpressure before compute
    decode -> router   Reserved(R, kv_address, ...)    or ReserveRejected(R): retry later
    router -> prefill  Prefill(R, prompt, sampling, KVDestination)
    prefill -> router  FirstToken(R, token)            at once: TTFT does not wait for KV
    prefill -> decode  KV page frames, then `done` carrying the first token (engine/kv_transfer/)
    prefill -> router  TransferEnded(R, state)         KV sent (or not): held pages freed
    decode -> router   Tokens(R, ids, finished?)       joined when the transfer is done; streamed
    router -> any      Abort(R)                        cancel/deadline: every side frees
    router -> worker   SetRole(role, reason)           a switchable worker's role flip (router/role_switch/)
    worker -> router   Failed(R, stage, reason)        a terminal failure on that worker
    worker -> router   Load(...)                       heartbeat: liveness, policy inputs, KV link states
    worker -> router   KVBlocks(...)                   prefix-cache changes: the router's KV block index
A colocated worker takes Generate(R, prompt, sampling) and answers with Tokens.
`encode` / `decode` turn a message into msgpack bytes and back, checking the type tag.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

import msgpack

# The public API's seed is a uint64 (proto/pdserve.proto) and the engine takes [-2**63, 2**64)
# (torch.Generator's range): on the wire it is checked against that range, not against int64
# like every other int, or a valid seed >= 2**63 would make each worker drop the command.
Seed = int


@dataclass(frozen=True)
class Sampling:
    """engine.SamplingParams' fields, as the router validated them."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Seed | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    speculative_method: str | None = None  # None: the pool's setting
    num_speculative_tokens: int | None = None


@dataclass(frozen=True)
class KVDestination:
    address: str  # host:port of the decode worker's KV receiver
    num_pages: int  # pages the prompt occupies
    skip_pages: int  # leading pages the decode side already holds (prefix cache): not sent
    timeout_s: float
    token: str = ""  # the reservation's secret: every KV frame carries it (Reserved.transfer_token)


@dataclass(frozen=True)
class ReserveKV:
    """Pages for the prompt, held `lease_s` for its KV; with the sampling settings, so the decode
    worker joins the request as soon as the transfer's final frame (with the first token) lands."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    lease_s: float
    sampling: Sampling


@dataclass(frozen=True)
class Reserved:
    request_id: str
    worker_id: str
    kv_address: str
    num_pages: int
    num_cached_pages: int
    transfer_token: str = ""  # random per reservation: only a sender told it can fill these pages


@dataclass(frozen=True)
class ReserveRejected:
    request_id: str
    worker_id: str
    reason: str


@dataclass(frozen=True)
class Prefill:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: Sampling
    kv: KVDestination


@dataclass(frozen=True)
class FirstToken:
    request_id: str
    worker_id: str
    token_id: int
    logprob: float | None
    num_cached_prompt_tokens: int


@dataclass(frozen=True)
class TransferEnded:
    request_id: str
    worker_id: str
    state: str  # engine.kv_transfer.TransferState value


@dataclass(frozen=True)
class Generate:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: Sampling


@dataclass(frozen=True)
class Tokens:
    request_id: str
    worker_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort"
    num_cached_prompt_tokens: int = 0
    spec_proposed_tokens: int = 0  # the request's speculative totals so far (usage)
    spec_accepted_tokens: int = 0


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class SetRole:
    """A switchable worker (cluster/role_switch/) now serves `role` ("prefill" or "decode"): the router
    routes only that role's work to it from now on, it finishes what it holds of the other (and
    serves any of the other's commands still on the way), and reports `role` in its heartbeats."""

    worker_id: str
    role: str
    reason: str


@dataclass(frozen=True)
class Failed:
    request_id: str
    worker_id: str
    stage: str  # "reserve", "prefill", "transfer", "decode", or "command" (a command the worker could not take)
    reason: str


@dataclass(frozen=True)
class KVLink:
    """A KV link as a worker reports it in its heartbeat: a prefill worker reports each decode
    endpoint it holds a link to; a decode worker only the sources it can no longer hear
    (torch_dist: `dist:<rank>`). `detail` says why a link is down."""

    address: str
    up: bool
    detail: str = ""
    bytes_per_s: float = 0.0  # measured on its real transfers (engine/kv_transfer/link_meter.py); 0 = not yet
    latency_s: float = 0.0


@dataclass(frozen=True)
class Load:
    """Heartbeat with the signals the router's policy and health checks use."""

    worker_id: str
    role: str  # "prefill", "decode", "colocated"
    queued_tokens: int
    free_pages: int
    running: int
    incarnation: str = ""  # new per worker process: a replacement under the same id is not the same worker
    kv_links: tuple[KVLink, ...] = ()  # the worker's KV links (router/worker_pool.py routes around dead ones)
    # Measured on the worker's own steps (engine/metrics/rates.py), 0 = not yet: what the router's
    # placement cost model (router/placement/) predicts queues and prefills with.
    prefill_tokens_per_s: float = 0.0
    decode_step_s: float = 0.0
    kv_bytes_per_token: int = 0  # what one token's KV weighs on the wire (the cost model's transfer term)


@dataclass(frozen=True)
class KVBlocks:
    """A worker's prefix-cache changes since its previous KVBlocks (engine/block_events.py): full
    pages now cached (`stored`) and evicted (`removed`), as short hashes (proto/block_hash.py).
    `seq` counts one worker process's messages from 0: the router forgets what it knew of a
    worker whose sequence skips (a message lost) or whose incarnation changed; `lost`: the
    worker itself dropped changes before these."""

    worker_id: str
    incarnation: str
    seq: int
    stored: tuple[int, ...]
    removed: tuple[int, ...]
    lost: bool = False


MESSAGE_TYPES = {cls.__name__: cls for cls in (
    ReserveKV, Reserved, ReserveRejected, Prefill, FirstToken, TransferEnded,
    Generate, Tokens, Abort, Failed, Load, KVBlocks, SetRole,
)}


def encode(message: Any) -> bytes:
    name = type(message).__name__
    if name not in MESSAGE_TYPES:
        raise TypeError(f"{name} is not a worker message")
    return msgpack.packb({"type": name, **asdict(message)}, use_bin_type=True)


def decode(data: bytes) -> Any:
    try:
        raw = msgpack.unpackb(data, raw=False)
    except (ValueError, TypeError, RecursionError, msgpack.UnpackException) as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    return _from_raw(raw)


def request_id_of(data: bytes) -> str | None:
    """The request id of an encoded message that `decode` refused, if it has a usable one (a
    string within the id bound), so the worker can say which request's command was bad; never
    raises."""
    try:
        raw = msgpack.unpackb(data, raw=False)
    except Exception:  # noqa: BLE001 - anything undecodable simply has no id
        return None
    rid = raw.get("request_id") if isinstance(raw, dict) else None
    return rid if type(rid) is str and 0 < len(rid) <= MAX_ID_CHARS else None


# Bounds every decoded message is held to: a peer cannot make the receiver allocate or log
# without limit, and a NaN or a bool never passes for a number.
MAX_ID_CHARS = 256  # request and worker ids
MAX_TEXT_CHARS = 4096  # reasons, addresses, finish reasons
MAX_ITEMS = 1 << 20  # token ids (or log-probabilities) in one message
MAX_INT = (1 << 63) - 1


def _int(name: str, value: Any) -> int:
    if type(value) is not int or not -MAX_INT <= value <= MAX_INT:
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    return value


def _seed(name: str, value: Any) -> int:
    if type(value) is not int or not -(1 << 63) <= value < 1 << 64:
        raise ValueError(f"{name} must be an int in [-2**63, 2**64), got {type(value).__name__}")
    return value


def _float(name: str, value: Any) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r:.40}")
    return float(value)


def _bool(name: str, value: Any) -> bool:
    if type(value) is not bool:
        raise ValueError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _str(name: str, value: Any) -> str:
    limit = MAX_ID_CHARS if name.endswith("_id") else MAX_TEXT_CHARS
    if type(value) is not str or len(value) > limit:
        raise ValueError(f"{name} must be a string of at most {limit} characters")
    return value


def _items(check: Callable[[str, Any], Any]) -> Callable[[str, Any], tuple]:
    def items(name: str, value: Any) -> tuple:
        if type(value) not in (list, tuple) or len(value) > MAX_ITEMS:
            raise ValueError(f"{name} must be a list of at most {MAX_ITEMS} items")
        return tuple(check(name, v) for v in value)

    return items


def _optional(check: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    return lambda name, value: None if value is None else check(name, value)


def _nested(cls: type) -> Callable[[str, Any], Any]:
    return lambda name, value: _build(cls, value, name)  # its fields are named under `name`


_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "int": _int, "float": _float, "bool": _bool, "str": _str,
    "int | None": _optional(_int), "Seed | None": _optional(_seed), "float | None": _optional(_float),
    "str | None": _optional(_str),
    "tuple[int, ...]": _items(_int), "tuple[float, ...]": _items(_float),
    "Sampling": _nested(Sampling), "KVDestination": _nested(KVDestination),
    "tuple[KVLink, ...]": _items(_nested(KVLink)),
}


def _build(cls: type, raw: Any, where: str) -> Any:
    """`cls` from a decoded map, every field checked against its declared type and bounds."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a map, got {type(raw).__name__}")
    names = {f.name for f in fields(cls)}
    if set(raw) != names:
        missing, unknown = sorted(names - set(raw)), sorted(map(str, set(raw) - names))[:20]
        raise ValueError(f"{where} ({cls.__name__}): " + "; ".join(
            part for part in (missing and f"missing fields {missing}", unknown and f"unknown fields {unknown}") if part))
    # Named with their path (Prefill.sampling.max_tokens): the error a worker sends back says which.
    return cls(**{f.name: _CHECKS[str(f.type)](f"{where}.{f.name}", raw[f.name]) for f in fields(cls)})


def from_map(raw: Any) -> Any:
    """A message from its decoded map (with its "type"), checked as `decode` checks it: what a
    flight recorder dump (proto/flight/dump.py) is read back with. Takes the map's "type" out."""
    return _from_raw(raw)


def _from_raw(raw: Any) -> Any:
    if not isinstance(raw, dict) or raw.get("type") not in MESSAGE_TYPES:
        raise ValueError(f"not a worker message: {str(raw)[:80]}")
    cls = MESSAGE_TYPES[raw.pop("type")]
    return _build(cls, raw, cls.__name__)
