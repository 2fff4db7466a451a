"""What other threads may know about an engine: an immutable snapshot its owning thread publishes.

The engine's scheduler and page manager belong to the thread that steps the engine (a worker's
serving thread, or the caller of `LLM.generate`). Heartbeats, `pdserve status` and Prometheus
scrapes run on threads of their own; they read `LLMEngine.snapshot`, a frozen object replaced
whole after every step and every change a role makes between steps (cluster/serving_loop.py
publishes once per loop turn), so a reader sees one consistent state, at most a step old, and
never iterates a structure the step thread is changing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.page_manager import PageManager
    from engine.scheduler import Scheduler


@dataclass(frozen=True)
class EngineSnapshot:
    num_running: int = 0  # sequences in the running batch
    num_waiting: int = 0  # sequences waiting to be scheduled
    num_pages: int = 0  # KV pages in the cache
    free_pages: int = 0  # allocatable: free or evictable prefix-cache pages
    referenced_pages: int = 0  # in use: running, held for a transfer, or reserved
    cached_pages: int = 0  # holding a reusable prefix
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache, ever
    prefix_hit_tokens: int = 0  # of which found
    num_steps: int = 0  # steps that computed something
    # Prompt tokens of scheduled or waiting sequences not computed yet (a decode worker's own
    # prompts placed on it: router/placement/ weighs its queue by them).
    pending_prompt_tokens: int = 0
    # Every request the engine holds anything for (a sequence, held or reserved pages): what a
    # leak check reads (cluster/worker_host.py held_request_ids).
    request_ids: frozenset[str] = frozenset()

    @classmethod
    def of(cls, scheduler: Scheduler, page_manager: PageManager, num_steps: int,
           request_ids: frozenset[str] = frozenset()) -> EngineSnapshot:
        """The state now: on the engine's own thread only."""
        pm, sched = page_manager, scheduler
        pending = sum(max(0, seq.num_prompt_tokens - seq.num_computed_tokens)
                      for queue in (sched.running, sched.waiting) for seq in queue)
        return cls(num_running=len(sched.running), num_waiting=len(sched.waiting), num_pages=pm.num_pages,
                   free_pages=pm.num_free_pages, referenced_pages=pm.num_referenced_pages,
                   cached_pages=pm.num_cached_pages, prefix_queried_tokens=pm.prefix_queries_tokens,
                   prefix_hit_tokens=pm.prefix_hit_tokens, num_steps=num_steps, pending_prompt_tokens=pending,
                   request_ids=request_ids)

    def page_stats(self) -> dict[str, int]:
        """The KV page counts in the shape `pdserve status` and the tests read."""
        return {"num_pages": self.num_pages, "free": self.free_pages, "referenced": self.referenced_pages,
                "cached": self.cached_pages}
