"""Making a role flip, by hand (`pdserve role`) or by the controller (controller.py), and the
controller's loop on the router's event loop.

A flip is one step on the router: the worker's SetRole goes out on its command socket and the
router's pool puts it in its new role at once (router/worker_pool.py `set_role`), so the next
placement already sees it there. Nothing it holds is moved or failed: the worker finishes its
old role's requests beside the new role's work (cluster/role_switch/switchable_worker.py).
Each flip is counted (`pdserve_role_flips_total{role,by}`), logged (`role_flip`) and shown by
`pdserve status` with its reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from configs.logging_setup import EventLog
from configs.role_switching import RoleSwitchingConfig
from router.role_switch.controller import Candidate, RoleController
from router.worker_pool import WorkerPool

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode")


class RoleFlipError(ValueError):
    """A flip that cannot be made; the message says why."""


class RoleSwitcher:
    def __init__(self, config: RoleSwitchingConfig, pool: Callable[[], WorkerPool | None], event_log: EventLog,
                 counted: Callable[[str, str], None], controller: RoleController | None = None) -> None:
        """`pool`: the router's worker pool (None before it starts); `counted(role, by)`: a flip
        was made (the metric); `controller`: decides flips (mode auto), None = by hand only."""
        self.config = config
        self._pool = pool
        self.log = event_log
        self._counted = counted
        self.controller = controller

    def observe(self, ttft_s: float | None, tpot_s: float | None) -> None:
        """A request finished with tokens: what the controller judges the mix by."""
        if self.controller is not None and ttft_s is not None:
            self.controller.observe(ttft_s, tpot_s)

    async def flip(self, worker_id: str, role: str, reason: str, by: str = "manual") -> dict:
        """Makes `worker_id` a `role` worker now, or raises RoleFlipError saying why not."""
        pool = self._pool()
        if self.config.mode == "off":
            raise RoleFlipError("role switching is off (router.role_switching.mode: manual or auto turns it on)")
        if pool is None:
            raise RoleFlipError("the router has not started")
        if role not in ROLES:
            raise RoleFlipError(f"a worker flips to one of {ROLES}, not {role!r}")
        endpoint = pool.endpoints.get(worker_id)
        if endpoint is None:
            raise RoleFlipError(f"no worker {worker_id!r}; the workers are {sorted(pool.endpoints)}")
        if not endpoint.switchable:
            raise RoleFlipError(f"{worker_id} is a {endpoint.role} worker that cannot switch roles")
        old = pool.role(worker_id)
        if old == role:
            raise RoleFlipError(f"{worker_id} already serves {role}")
        if not pool.healthy(worker_id):
            raise RoleFlipError(f"{worker_id} is not healthy: a flip would route work to a worker that cannot take it")
        if old == "decode" and not any(w.healthy and w.worker_id != worker_id for w in pool.loads("decode")):
            raise RoleFlipError(f"{worker_id} is the only healthy decode worker: every request needs one")
        await pool.set_role(worker_id, role, reason, by)
        if self.controller is not None:
            self.controller.flipped()
        self._counted(role, by)
        self.log.event("role_flip", None, worker=worker_id, old=old, new=role, reason=reason, by=by)
        return {"worker_id": worker_id, "old": old, "role": role, "reason": reason}

    async def run(self) -> None:
        """The controller's loop (mode auto): every interval_s, the flip it decides, if any."""
        assert self.controller is not None
        while True:
            await asyncio.sleep(self.config.interval_s)
            pool = self._pool()
            if pool is None:
                continue
            candidates = [Candidate(w.worker_id, role, w.healthy, w.running, w.queued_tokens)
                          for role in ROLES for w in pool.loads(role) if pool.endpoints[w.worker_id].switchable]
            choice = self.controller.decide(candidates)
            if choice is None:
                continue
            try:
                await self.flip(choice.worker_id, choice.role, choice.reason, by="controller")
            except (RoleFlipError, LookupError) as exc:  # it left, or fell ill, since it was read
                log.warning("role flip of %s not made: %s", choice.worker_id, exc)
