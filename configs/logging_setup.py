"""Structured logs for every pdserve process: one setup call per process, one event logger per
component, and a request id that follows a request across router, prefill and decode.

Lives in configs/ because every layer may import configs (docs/design.md §1), including the
torch-free router. Data flow: the composition root (cluster/) calls `setup_logging` once when a
process starts, with the cluster YAML's `logging:` block; each component (the router, every
worker role) holds an `EventLog(component, worker_id)` and calls `event("admitted",
request_id, num_tokens=...)` at lifecycle points, never per token. The component and worker
id travel on each record (not in process state), so several workers in one test process stay
apart. JSON lines carry: ts, level, component, worker_id, request_id, event, fields.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from typing import IO, Any, Literal

from pydantic import BaseModel, ConfigDict

LOGGER_PREFIX = "pdserve"


class LoggingConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    format: Literal["json", "text"] = "text"
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"


def _record_fields(record: logging.LogRecord, default_component: str, default_worker_id: str | None) -> dict:
    """The structured view of any record: pdserve events carry their own attributes, other
    libraries' records get the process defaults and their message as the event."""
    return {
        "ts": round(record.created, 6),
        "level": record.levelname,
        "component": getattr(record, "component", default_component),
        "worker_id": getattr(record, "worker_id", default_worker_id),
        "request_id": getattr(record, "request_id", None),
        "event": getattr(record, "event", record.getMessage()),
        "fields": getattr(record, "fields", {}),
    }


class JsonFormatter(logging.Formatter):
    def __init__(self, component: str, worker_id: str | None = None) -> None:
        super().__init__()
        self.component, self.worker_id = component, worker_id

    def format(self, record: logging.LogRecord) -> str:
        out = _record_fields(record, self.component, self.worker_id)
        if record.exc_info:
            out["fields"] = {**out["fields"], "exception": self.formatException(record.exc_info)}
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self, component: str, worker_id: str | None = None) -> None:
        super().__init__()
        self.component, self.worker_id = component, worker_id

    def format(self, record: logging.LogRecord) -> str:
        f = _record_fields(record, self.component, self.worker_id)
        when = time.strftime("%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        who = f["component"] + (f"[{f['worker_id']}]" if f["worker_id"] else "")
        parts = [when, f["level"], who, f["event"]]
        if f["request_id"]:
            parts.append(f"request_id={f['request_id']}")
        parts += [f"{k}={v}" for k, v in f["fields"].items()]
        line = " ".join(parts)
        return line + ("\n" + self.formatException(record.exc_info) if record.exc_info else "")


def setup_logging(config: LoggingConfig, component: str, worker_id: str | None = None,
                  stream: IO[str] | None = None) -> logging.Handler:
    """Routes this process's logs (root logger) through one pdserve handler in the configured
    format and level; `component` / `worker_id` label records that do not name their own.
    Calling it again replaces the handler it installed. Returns the handler (tests remove it)."""
    formatter = (JsonFormatter if config.format == "json" else TextFormatter)(component, worker_id)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter)
    handler._pdserve = True  # type: ignore[attr-defined]  # marks the handler a later call replaces
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_pdserve", False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(config.level)
    return handler


class EventLog:
    """Lifecycle events of one component (router, or one worker): `event(name, request_id,
    **fields)`. Call at state changes only (received, admitted, finished ...), never per token."""

    def __init__(self, component: str, worker_id: str | None = None) -> None:
        self.component, self.worker_id = component, worker_id
        self.logger = logging.getLogger(f"{LOGGER_PREFIX}.{component}")
        # Sees every event, whatever the log level: the flight recorder's state changes (proto/flight/).
        self.tap: Callable[[str, str | None, dict[str, Any]], None] | None = None

    def event(self, name: str, request_id: str | None = None, level: int = logging.INFO, **fields: Any) -> None:
        if self.tap is not None:
            self.tap(name, request_id, fields)
        if not self.logger.isEnabledFor(level):
            return
        self.logger.log(level, "%s", name, extra={
            "component": self.component, "worker_id": self.worker_id, "request_id": request_id,
            "event": name, "fields": fields})
