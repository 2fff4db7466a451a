"""`pdserve debug dump`'s collection: every process's flight recorder dump (proto/flight/) of a
running cluster, fetched through Ray from the router actor and each worker actor by the `up`
process (cluster/control.py op "flight_dump") and written by the CLI where the user asked
(cluster/cmd_debug.py). A worker that does not answer is named with why, not skipped silently."""

from __future__ import annotations

from typing import Any

from cluster.launcher import RunningCluster


def collect(cluster: RunningCluster, timeout_s: float = 30.0) -> tuple[dict[str, str], dict[str, str]]:
    """({process name: dump text}, {process name: why it gave none})."""
    import ray

    dumps: dict[str, str] = {}
    missing: dict[str, str] = {}
    actors: list[tuple[str, Any]] = [("router", cluster.router)]
    actors += [(wid, slot.actor) for wid, slot in sorted(dict(cluster.slots).items())]
    pending = {name: actor.flight_dump.remote() for name, actor in actors}
    for name, ref in pending.items():
        try:
            _, text = ray.get(ref, timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - a dead or busy worker is reported, the others dumped
            missing[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
            continue
        if text:
            dumps[name] = text
        else:
            missing[name] = "its flight recorder is off (flight_recorder.enabled: false)"
    return dumps, missing
