"""The flight recorder's dump file: JSON lines, no pickle, readable by eye and by `pdserve replay`.

Line 1 is the header {"format": FORMAT, "component", "worker_id", "pid", "reason", "written_at",
"header": the recorder's own (engine settings for a replay)}; each further line one entry, oldest
first: {"t", "kind": in|out|state, "request_id", "peer", and "message" (a worker message as a map
with its "type", proto/worker_messages.py) or "event" + "fields"}. Messages are decoded here, at
dump time, from the bytes the recorder kept; one that does not decode (the recorder also keeps
commands a worker refused) is written as {"undecodable": why}.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from proto import worker_messages as wm
from proto.flight.recorder import STATE, Entry, FlightRecorder

FORMAT = "pdserve-flight/1"
SUFFIX = ".flight.jsonl"


def entry_map(entry: Entry) -> dict[str, Any]:
    out: dict[str, Any] = {"t": round(entry.t, 6), "kind": entry.kind, "request_id": entry.request_id,
                           "peer": entry.peer}
    if entry.kind == STATE:
        assert isinstance(entry.payload, dict)
        out.update(entry.payload)
        return out
    try:
        raw = msgpack.unpackb(entry.payload, raw=False)
        wm.from_map(dict(raw))  # only what the receiver would accept is written as a message
        out["message"] = raw
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        out["message"] = {"undecodable": str(exc)[:300]}
    return out


def render(recorder: FlightRecorder, reason: str, request_id: str | None = None) -> str:
    """The dump of `recorder` (only `request_id`'s entries when given) as one string."""
    head = {"format": FORMAT, "component": recorder.component, "worker_id": recorder.worker_id, "pid": os.getpid(),
            "reason": reason, "written_at": round(time.time(), 3), "header": recorder.header}
    lines = [json.dumps(head, default=str)]
    lines += [json.dumps(entry_map(e), default=str) for e in recorder.entries(request_id)]
    return "\n".join(lines) + "\n"


def write(recorder: FlightRecorder, directory: str | Path, reason: str, request_id: str | None = None) -> Path:
    """Writes the dump into `directory` (made if missing) under a name that says whose, when and
    why; returns its path. The file appears whole (written aside, then renamed)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S") + f"{time.time() % 1:.3f}"[1:]
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", reason)[:40].strip("-") or "dump"
    path = directory / f"{recorder.name}-{os.getpid()}-{stamp}-{slug}{SUFFIX}"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(render(recorder, reason, request_id))
    tmp.replace(path)
    return path


@dataclass(frozen=True)
class Dump:
    """A dump read back: its header line and its entries (maps, as written)."""

    path: str
    head: dict[str, Any]
    entries: tuple[dict[str, Any], ...]

    @property
    def component(self) -> str:
        return str(self.head["component"])

    @property
    def name(self) -> str:
        return str(self.head.get("worker_id") or self.head["component"])

    def messages(self) -> Iterator[tuple[dict[str, Any], Any]]:
        """(entry, the worker message it carries) for every decodable message entry."""
        for e in self.entries:
            raw = e.get("message")
            if isinstance(raw, dict) and "type" in raw:
                yield e, wm.from_map(dict(raw))


def read(path: str | Path) -> Dump:
    """A dump file; ValueError naming the line when it is not one."""
    text = Path(path).read_text().splitlines()
    if not text:
        raise ValueError(f"{path}: empty, not a flight recorder dump")
    rows = []
    for number, line in enumerate(text, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
    head = rows[0]
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise ValueError(f"{path}: not a flight recorder dump (line 1 has no format {FORMAT!r})")
    return Dump(str(path), head, tuple(rows[1:]))


def find(target: str | Path) -> list[Path]:
    """A dump file, or every dump in a directory (what `pdserve debug dump` writes), sorted."""
    target = Path(target)
    if target.is_dir():
        found = sorted(target.glob(f"*{SUFFIX}"))
        if not found:
            raise FileNotFoundError(f"{target}: no *{SUFFIX} files")
        return found
    if not target.is_file():
        raise FileNotFoundError(f"{target}: no such dump file or directory")
    return [target]
