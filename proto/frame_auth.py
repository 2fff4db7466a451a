"""Peer authentication of every internal ZMQ message: an HMAC under the cluster's secret.

Where it sits: every internal socket (router -> worker commands, worker -> router events,
prefill -> decode KV frames, the `up` process's control socket) sends a message as ZMQ parts
`[auth, *parts]`; the sender's `FrameSigner` makes `auth`, the receiving socket's
`FrameVerifier` checks it before a byte of `parts` is parsed. A message that fails is dropped
and counted by the socket's owner under the `AuthError`'s reason; it gets nothing done.

Why HMAC and not ZMQ CURVE: the same check then covers the ZMQ sockets and the KV frames that
go over torch.distributed, every rejection is seen (and counted with its reason) by the loop that
owns the socket rather than inside a ZAP handler thread, and a KV page frame need not be
encrypted (CURVE would cost a pass of Salsa20/Poly1305 over every page). Nothing is encrypted
here: the secret proves who sent a message, not who may read it (README "Security").

`auth` is 28 fixed bytes plus the sender id: b"PDA1", a 64-bit counter, a 16-byte tag (HMAC-SHA256
truncated to 128 bits), then the sender's id. The tag covers the sender id, the counter, the
audience (the address the receiver bound, as the sender dialled it, so a message recorded on
one socket is refused by every other) and each part with its length (parts cannot be shifted).

Replay: each signer has an id of its own (`<name>.<random>`, one per sending socket, so two
sockets of one process never share a counter) and a strictly increasing counter that starts at
the wall clock in nanoseconds. A verifier takes a counter only above the last one it took from
that sender, and only within `window_s` of its own clock: a sender it has not heard from in
that long is forgotten, and any message of it replayed later is too old. The table therefore
holds only senders that proved the secret in the last window. Clocks of the cluster's machines
must agree within the window (NTP does far better).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import threading
import time
from collections.abc import Callable, Sequence

MAGIC = b"PDA1"
TAG_BYTES = 16
_HEAD = struct.Struct(">4sQ16s")  # magic, counter, tag
MAX_SENDER_BYTES = 96
MIN_SECRET_CHARS = 16
DEFAULT_WINDOW_S = 300.0  # counters this far from the receiver's clock are refused (clock skew + queueing)
Buffer = bytes | memoryview


class AuthError(ValueError):
    """A message that fails authentication; `reason` is what it is counted under."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class ClusterSecret:
    """The per-cluster key: printable ASCII without spaces (it lives in an environment variable
    or a file), at least MIN_SECRET_CHARS long; `generate` makes 64 hex digits (256 bits).
    Never shown: repr and str hide it, and it is not a str, so a log line or an f-string of a
    spec holding it shows `ClusterSecret(****)`."""

    __slots__ = ("_key",)

    def __init__(self, text: str) -> None:
        text = text.strip() if isinstance(text, str) else text
        if type(text) is not str or len(text) < MIN_SECRET_CHARS or not text.isascii() or not text.isprintable() \
                or any(c.isspace() for c in text):
            raise ValueError(f"a cluster secret is at least {MIN_SECRET_CHARS} printable ASCII characters without "
                             "spaces (e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)")
        self._key = text.encode()

    @classmethod
    def generate(cls) -> ClusterSecret:
        return cls(secrets.token_hex(32))

    def reveal(self) -> str:
        """The text itself: only ever written to a 0600 file or a child's environment."""
        return self._key.decode()

    @property
    def key(self) -> bytes:
        return self._key

    def __repr__(self) -> str:
        return "ClusterSecret(****)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterSecret) and hmac.compare_digest(self._key, other._key)

    def __hash__(self) -> int:
        return hash(ClusterSecret)

    def __reduce__(self):  # Ray hands specs to actors by cloudpickle (never on a pdserve socket)
        return (ClusterSecret, (self.reveal(),))


def _tag(key: bytes, sender: bytes, counter: int, audience: str, parts: Sequence[Buffer]) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    mac.update(struct.pack(">H", len(sender)) + sender + struct.pack(">Q", counter))
    encoded = audience.encode()
    mac.update(struct.pack(">H", len(encoded)) + encoded)
    for part in parts:
        mac.update(struct.pack(">Q", len(part)))
        mac.update(part)
    return mac.digest()[:TAG_BYTES]


class FrameSigner:
    """Signs what one sending socket sends (not shared between sockets: each receiver must see
    one signer's counters in the order it made them, which one ZMQ connection guarantees).
    Thread-safe, though each socket is used by one thread."""

    def __init__(self, secret: ClusterSecret, name: str, clock_ns: Callable[[], int] = time.time_ns) -> None:
        """`name`: who sends, for the receiver's log lines (a worker id, "router", "control")."""
        self.sender = f"{name[:64]}.{secrets.token_hex(6)}"
        self._sender = self.sender.encode()[:MAX_SENDER_BYTES]
        self._key = secret.key
        self._clock_ns = clock_ns
        self._counter = 0
        self._lock = threading.Lock()

    def sign(self, audience: str, parts: Sequence[Buffer]) -> bytes:
        """The `auth` part to send before `parts` to the socket bound at `audience`."""
        with self._lock:
            self._counter = max(self._counter + 1, self._clock_ns())
            counter = self._counter
        return _HEAD.pack(MAGIC, counter, _tag(self._key, self._sender, counter, audience, parts)) + self._sender

    def wrap(self, audience: str, *parts: Buffer) -> list[Buffer]:
        """`[auth, *parts]`: the multipart message to send."""
        return [self.sign(audience, parts), *parts]


class FrameVerifier:
    """Checks what one receiving socket takes (one thread: the socket's). `verify` raises
    AuthError with reason "unauthenticated" (no or malformed auth, wrong secret, tampered,
    truncated or re-addressed message), "replayed" (a counter at or below the sender's last)
    or "stale" (a counter outside the window)."""

    def __init__(self, secret: ClusterSecret, audience: str, window_s: float = DEFAULT_WINDOW_S,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        """`audience`: the address this socket bound, as its senders dial it (host:port)."""
        self._key = secret.key
        self.audience = audience
        self._window_ns = int(window_s * 1e9)
        self._clock_ns = clock_ns
        self._last: dict[bytes, int] = {}  # sender -> the last counter taken from it
        self._next_sweep_ns = 0

    def verify(self, message: Sequence[Buffer]) -> tuple[str, list[Buffer]]:
        """(the sender's id, the parts after `auth`) of an authentic, fresh message."""
        if not message:
            raise AuthError("unauthenticated", "an empty message")
        auth = bytes(message[0][: _HEAD.size + MAX_SENDER_BYTES + 1])
        if len(auth) <= _HEAD.size or len(auth) > _HEAD.size + MAX_SENDER_BYTES or auth[:4] != MAGIC:
            raise AuthError("unauthenticated", "no authentication part (is the peer in this cluster?)")
        _, counter, tag = _HEAD.unpack_from(auth)
        sender, parts = auth[_HEAD.size:], list(message[1:])
        if not hmac.compare_digest(tag, _tag(self._key, sender, counter, self.audience, parts)):
            raise AuthError("unauthenticated", f"bad signature from {_shown(sender)} (another secret, or altered)")
        now = self._clock_ns()
        if abs(counter - now) > self._window_ns:
            raise AuthError("stale", f"{_shown(sender)}'s counter is {(now - counter) / 1e9:.0f} s off this clock")
        if counter <= self._last.get(sender, 0):
            raise AuthError("replayed", f"{_shown(sender)} counter {counter} already seen")
        self._last[sender] = counter
        if now >= self._next_sweep_ns:  # forget senders silent for a window: their replays are stale now
            self._last = {s: c for s, c in self._last.items() if now - c <= self._window_ns}
            self._next_sweep_ns = now + self._window_ns
        return sender.decode(errors="replace"), parts


def _shown(sender: bytes) -> str:
    return repr(sender.decode(errors="replace")[:MAX_SENDER_BYTES])
