"""SIGUSR1 dumps every flight recorder of this process (`kill -USR1 PID`): what an operator does
to a router or worker that looks stuck, without stopping it.

The handler runs on the main thread between bytecodes (Python's signal rule), so it only writes
files; the rings it copies are appended to by other threads, which the copy never tears
(recorder.py). Installed by each process's composition root (cluster/actors.py); a process that
cannot install it (not on its main thread) logs why and goes on without."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

from proto.flight.dump import write
from proto.flight.recorder import live_recorders

log = logging.getLogger(__name__)


def dump_all(directory: str | Path, reason: str) -> list[Path]:
    """Every live recorder of this process to `directory`; returns the files written."""
    paths = []
    for recorder in live_recorders():
        try:
            paths.append(write(recorder, directory, reason))
        except OSError as exc:
            log.error("flight recorder %s: could not write a dump to %s: %s", recorder.name, directory, exc)
    return paths


def install_sigusr1(directory: str | Path) -> bool:
    """SIGUSR1 -> `dump_all(directory, "SIGUSR1")`; False (and a log line) where it cannot be set."""
    if threading.current_thread() is not threading.main_thread():
        log.warning("flight recorder: SIGUSR1 dumps not installed (not on the main thread)")
        return False

    def on_signal(signum, frame) -> None:
        for path in dump_all(directory, "SIGUSR1"):
            log.warning("flight recorder dumped to %s (SIGUSR1)", path)

    try:
        signal.signal(signal.SIGUSR1, on_signal)
    except (ValueError, OSError) as exc:
        log.warning("flight recorder: SIGUSR1 dumps not installed: %s", exc)
        return False
    return True
