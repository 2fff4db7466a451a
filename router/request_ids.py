"""The two ids of one request, as the router (router/server.py) hands them out at arrival.

A client's request id (gRPC `request_id`, HTTP `X-Request-Id`, or one the router makes when it
gives none) is for the client: echoed in every response and logged beside the internal id so
an operator can find the request, and nothing more. Every worker, KV transfer, page
reservation and abort sees only the **internal** id, which the router makes for each request:
a client cannot choose or guess the name its request goes by inside the cluster, so it can
neither collide with another client's request there nor forge events or aborts for it.

`LiveIds` holds the client ids in flight: a second live request under one client id is
ALREADY_EXISTS (the client could not tell the two streams apart in its own logs); an ended id
is free again.
"""

from __future__ import annotations

import secrets
import uuid

import grpc

from router.journey_state import RouterError

# 96 random bits: unguessable, and short (24 characters, plus ".retry<k>" on a retry) in
# every worker message and log line.
INTERNAL_ID_BYTES = 12


def new_internal_id() -> str:
    return secrets.token_hex(INTERNAL_ID_BYTES)


def new_client_id() -> str:
    """The id a client that gave none is answered with (echoed, logged; never sent to workers)."""
    return uuid.uuid4().hex


class LiveIds:
    """Client id -> internal id of every admitted request not yet ended (the router's event loop
    is its only writer; `internal_id` is a plain dict read, safe from another thread)."""

    def __init__(self) -> None:
        self._internal: dict[str, str] = {}

    def admit(self, client_id: str, internal_id: str) -> None:
        if client_id in self._internal:
            raise RouterError(grpc.StatusCode.ALREADY_EXISTS, f"request id {client_id!r} is already in flight")
        self._internal[client_id] = internal_id

    def end(self, client_id: str, internal_id: str) -> None:
        """Frees `client_id`, if it is still `internal_id`'s (a refused duplicate frees nothing)."""
        if self._internal.get(client_id) == internal_id:
            del self._internal[client_id]

    def internal_id(self, client_id: str) -> str | None:
        """The internal id of the live request under `client_id` (operators' and tests' lookup)."""
        return self._internal.get(client_id)

    def __len__(self) -> int:
        return len(self._internal)

    def internal_ids(self) -> set[str]:
        return set(self._internal.values())
