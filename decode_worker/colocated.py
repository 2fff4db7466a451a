"""The colocated role: one engine does prefill and decode (chunked prefill interleaves them).
The baseline every benchmark compares against, and the fallback when a pool is unhealthy.
Lifecycle events (admitted, finished, aborted) go to the structured log under the router's
request id."""

from __future__ import annotations

from collections.abc import Callable

from configs.logging_setup import EventLog
from decode_worker.worker import admit_whole_request, tokens_message
from engine import LLMEngine
from proto.worker_messages import Abort, Generate


class ColocatedWorker:
    batch_events = True  # a step's Tokens leave as one frame (cluster/serving_loop.py EventSink)

    def __init__(self, worker_id: str, engine: LLMEngine, emit: Callable[[object], None]) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.emit = emit
        self.log = EventLog("colocated", worker_id)

    def handle(self, message: object) -> None:
        if isinstance(message, Generate):
            admit_whole_request(self.engine, message, self.worker_id, self.emit, self.log)
        elif isinstance(message, Abort):
            if self.engine.abort_request(message.request_id):
                self.log.event("aborted", message.request_id)
        else:
            raise ValueError(f"a colocated worker does not take {type(message).__name__}")

    def step(self) -> bool:
        if not self.engine.has_unfinished_requests():
            return False
        for out in self.engine.step():
            if out.finished:
                self.log.event("finished", out.request_id, finish_reason=out.finish_reason.value,
                               completion_tokens=len(out.token_ids))
            self.emit(tokens_message(self.worker_id, out))
        return True

    def publish(self) -> None:
        """What other threads read (heartbeats, status, metrics) made current; on this thread."""
        self.engine.publish_snapshot()
