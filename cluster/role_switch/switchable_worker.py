"""A worker that can be a prefill or a decode worker, and flips between them without a restart.

Where it sits: WorkerHost (cluster/worker_host.py) runs it in place of a plain role when the
cluster's `router.role_switching.mode` is not `off`. It holds both roles on one engine: the
prefill role (PrefillWorker, with KV links to every decode-capable worker) and the decode role
(DecodeWorker, with its own KV receiver bound). `role` says which one takes new work: a
SetRole command from the router (router/role_switch/) flips it. What the old role holds is
finished, never dropped: a prefill job in progress computes and ships its KV, a decode
sequence decodes to its end, both in the same engine steps as the new role's work (the engine
batches prompts and decodes together, as a colocated worker does). So a flip fails nothing,
and the router routes the new role's work to the worker the moment it decides.

A command of the role it no longer holds is still served, not refused, and counted in
`late_commands`: the router may have chosen this worker for a request before the flip and send
the command after it (a prompt's prefill worker is chosen, then the decode worker's reservation
awaited, then the prompt sent), and refusing it would fail that request.
"""

from __future__ import annotations

from decode_worker.worker import DecodeWorker
from prefill_worker.worker import PrefillWorker
from proto.worker_messages import Abort, Generate, Prefill, ReserveKV, SetRole

ROLES = ("prefill", "decode")


class SwitchableWorker:
    def __init__(self, prefill: PrefillWorker, decode: DecodeWorker, role: str) -> None:
        """`prefill`, `decode`: the two roles, on one engine; `role`: the one it starts as."""
        if prefill.engine is not decode.engine:
            raise ValueError("a switchable worker's two roles share one engine")
        if role not in ROLES:
            raise ValueError(f"a switchable worker starts as one of {ROLES}, not {role!r}")
        self.worker_id = prefill.worker_id
        self.engine = prefill.engine
        self.prefill, self.decode = prefill, decode
        self.role = role
        self.last_flip: tuple[str, str] | None = None  # (role, reason) of the last SetRole
        self.late_commands: dict[str, int] = {}  # the other role's commands served after a flip, by type
        self.log = decode.log  # where flips are logged; each role logs its own requests
        self.logs = (prefill.log, decode.log)  # what the flight recorder taps (cluster/worker_host.py)

    @property
    def batch_events(self) -> bool:
        # As the role it holds: a prefill worker's first tokens leave as they are made.
        return self.role == "decode"

    @property
    def rejected(self) -> dict[str, int]:
        return self.prefill.rejected

    @property
    def held_ids(self) -> frozenset[str]:
        return self.prefill.held_ids | self.decode.held_ids

    @property
    def queued_tokens(self) -> int:
        return self.prefill.queued_tokens

    def handle(self, message: object) -> None:
        if isinstance(message, SetRole):
            self._set_role(message)
        elif isinstance(message, Abort):  # either role may hold it
            self.prefill.handle(message)
            self.decode.handle(message)
        elif isinstance(message, Prefill):
            self._count_late("prefill", message)
            self.prefill.handle(message)
        elif isinstance(message, ReserveKV | Generate):
            self._count_late("decode", message)
            self.decode.handle(message)
        else:
            raise ValueError(f"a switchable worker does not take {type(message).__name__}")

    def step(self, idle_wait_s: float = 0.005) -> bool:
        """One turn of both roles on one engine step: KV taken in and joined, the step (prompts
        and decodes together), first tokens and Tokens out, new KV pages shipped."""
        # A prefill job is an unfinished engine request until the step that computes its last
        # chunk, which also ships the rest and ends it: nothing to ship while the engine idles.
        ahead = self.decode.take_kv(idle_wait_s)
        if not self.engine.has_unfinished_requests():
            return ahead
        outputs = self.engine.step()
        self.prefill.take_outputs(out for out in outputs if self.prefill.owns(out.request_id))
        self.decode.emit_outputs(out for out in outputs if not self.prefill.owns(out.request_id))
        self.prefill.ship()
        return True

    def publish(self) -> None:
        self.engine.publish_snapshot()
        self.prefill.publish_own()
        self.decode.publish_own()

    def _count_late(self, role: str, message: object) -> None:
        if self.role != role:
            name = type(message).__name__
            self.late_commands[name] = self.late_commands.get(name, 0) + 1
            self.log.event("late_command", getattr(message, "request_id", None), command=name, serving=self.role)

    def _set_role(self, message: SetRole) -> None:
        if message.role not in ROLES:
            raise ValueError(f"SetRole.role must be one of {ROLES}, not {message.role!r}")
        if message.worker_id != self.worker_id:
            raise ValueError(f"SetRole for {message.worker_id!r} reached {self.worker_id}")
        old, self.role = self.role, message.role
        self.last_flip = (message.role, message.reason)
        self.log.event("role_flip", None, worker=self.worker_id, old=old, new=message.role, reason=message.reason,
                       prefill_jobs=len(self.prefill.held_ids), decoding=self.engine.snapshot.num_running)
