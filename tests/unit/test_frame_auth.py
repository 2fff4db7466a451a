"""Signing and checking internal messages (proto/frame_auth.py): only a message signed under the
cluster's secret, for this socket, unaltered, whole and never seen before is taken; each refusal
names the reason it is counted under."""

from __future__ import annotations

import pickle

import pytest

from proto.frame_auth import AuthError, ClusterSecret, FrameSigner, FrameVerifier

SECRET = ClusterSecret("s" * 16 + "-unit-test-secret")
ADDRESS = "127.0.0.1:5555"


class Clock:
    def __init__(self, now_s: float = 1_700_000_000.0) -> None:
        self.ns = int(now_s * 1e9)

    def __call__(self) -> int:
        return self.ns


def pair(clock: Clock | None = None, secret: ClusterSecret = SECRET, window_s: float = 300.0):
    clock = clock or Clock()
    return FrameSigner(secret, "decode-0", clock), FrameVerifier(SECRET, ADDRESS, window_s, clock)


def reason(verifier: FrameVerifier, message) -> str:
    with pytest.raises(AuthError) as info:
        verifier.verify(message)
    return info.value.reason


def test_a_signed_message_is_taken_with_its_parts_and_sender():
    signer, verifier = pair()
    sender, parts = verifier.verify(signer.wrap(ADDRESS, b"header", memoryview(b"payload")))
    assert parts[0] == b"header" and bytes(parts[1]) == b"payload"
    assert sender == signer.sender and sender.startswith("decode-0.")


@pytest.mark.parametrize("message", [[], [b"hello"], [b"", b"x"], [b"PDA1" + b"\0" * 40, b"x"], [b"x" * 500, b"y"]])
def test_a_message_without_a_signature_is_unauthenticated(message):
    assert reason(pair()[1], message) == "unauthenticated"


def test_another_secret_is_unauthenticated():
    signer, verifier = pair(secret=ClusterSecret("another-secret-of-16+chars"))
    assert reason(verifier, signer.wrap(ADDRESS, b"cmd")) == "unauthenticated"


def test_tampered_truncated_reordered_or_readdressed_messages_are_unauthenticated():
    signer, verifier = pair()
    auth, header, payload = signer.wrap(ADDRESS, b"header", b"payload")
    assert reason(verifier, [auth, header, b"payloaD"]) == "unauthenticated"  # payload altered
    assert reason(verifier, [auth, header, b"payloa"]) == "unauthenticated"  # payload truncated
    assert reason(verifier, [auth, header]) == "unauthenticated"  # a part dropped
    assert reason(verifier, [auth, b"headerpayload", b""]) == "unauthenticated"  # bytes moved across parts
    assert reason(verifier, [auth[:-1], header, payload]) == "unauthenticated"  # sender id cut
    assert reason(verifier, [auth[:20], header, payload]) == "unauthenticated"  # auth cut
    forged_counter = auth[:4] + bytes([auth[4] ^ 1]) + auth[5:]
    assert reason(verifier, [forged_counter, header, payload]) == "unauthenticated"
    other = signer.wrap("127.0.0.1:5556", b"header", b"payload")  # meant for another socket
    assert reason(verifier, other) == "unauthenticated"
    verifier.verify([auth, header, payload])  # the original still passes: nothing above was taken


def test_a_replayed_or_older_counter_is_replayed():
    signer, verifier = pair()
    first, second = signer.wrap(ADDRESS, b"a"), signer.wrap(ADDRESS, b"b")
    verifier.verify(first)
    assert reason(verifier, first) == "replayed"
    verifier.verify(second)
    assert reason(verifier, first) == "replayed"  # older than the last one taken
    assert reason(verifier, second) == "replayed"


def test_counters_are_per_sender_so_two_sockets_of_one_process_interleave():
    clock = Clock()
    verifier = FrameVerifier(SECRET, ADDRESS, clock_ns=clock)
    beats, events = FrameSigner(SECRET, "decode-0", clock), FrameSigner(SECRET, "decode-0", clock)
    late = beats.wrap(ADDRESS, b"beat")
    verifier.verify(events.wrap(ADDRESS, b"event"))
    verifier.verify(events.wrap(ADDRESS, b"event"))
    verifier.verify(late)  # signed before the events, by another signer: still fresh


def test_counters_outside_the_window_are_stale_and_forgotten_senders_cannot_be_replayed():
    clock = Clock()
    signer, verifier = pair(clock, window_s=10)
    old = signer.wrap(ADDRESS, b"a")
    verifier.verify(signer.wrap(ADDRESS, b"b"))
    clock.ns += int(11e9)
    verifier.verify(FrameSigner(SECRET, "router", clock).wrap(ADDRESS, b"c"))  # sweeps the silent sender
    assert reason(verifier, old) == "stale"
    ahead = FrameSigner(SECRET, "x", lambda: clock.ns + int(60e9)).wrap(ADDRESS, b"d")
    assert reason(verifier, ahead) == "stale"  # a clock far ahead


def test_a_restarted_sender_is_taken_again():
    clock = Clock()
    verifier = FrameVerifier(SECRET, ADDRESS, clock_ns=clock)
    verifier.verify(FrameSigner(SECRET, "decode-0", clock).wrap(ADDRESS, b"a"))
    verifier.verify(FrameSigner(SECRET, "decode-0", clock).wrap(ADDRESS, b"a"))  # a new process, same clock


def test_the_secret_never_shows_and_survives_ray_handoff():
    secret = ClusterSecret.generate()
    assert len(secret.reveal()) == 64 and secret.reveal() not in repr(secret) + str(secret) + f"{secret}"
    assert pickle.loads(pickle.dumps(secret)) == secret
    assert ClusterSecret(secret.reveal() + "\n") == secret  # read from a file
    for bad in ["short", "x" * 15, "with space in it!!", "tab\tin\tthe\tsecret", "é" * 20, 12345678901234567]:
        with pytest.raises(ValueError, match="cluster secret"):
            ClusterSecret(bad)  # type: ignore[arg-type]
