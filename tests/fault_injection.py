"""Fault injection for tests: an event tap (cluster/worker_host.py `event_tap`) that crashes a
worker at a chosen event, before or after sending it, as a killed process would stop: mid-request,
sending nothing more. Lives with the tests; nothing shipped imports it."""

from __future__ import annotations

from collections.abc import Callable

Emit = Callable[[object], None]


class InjectedCrash(BaseException):
    """BaseException: no role code may swallow it; the host treats it as its loop dying."""


def crash_tap(worker_id: str, when: Callable[[object], str | None]) -> Callable[[Emit], Emit]:
    """`when(message)` answers "before" or "after" (sending it) to crash there, None to go on."""

    def tap(emit: Emit) -> Emit:
        def emit_or_crash(message: object) -> None:
            moment = when(message)
            if moment == "after":
                emit(message)
            if moment is not None:
                raise InjectedCrash(f"{worker_id}: injected crash at {type(message).__name__} ({moment})")
            emit(message)

        return emit_or_crash

    return tap
