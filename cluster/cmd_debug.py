"""`pdserve debug dump` and `pdserve replay`: the flight recorder from the command line.

`debug dump CONFIG` asks the running cluster's `up` process (control op "flight_dump",
cluster/control.py) for every process's ring (proto/flight/) and writes one file per process;
`replay DUMP` re-drives a worker's dump, or every dump in a directory, into in-process twins
(cluster/flight_replay.py) and says, request by request, whether each reached the same end.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def debug_dump(args: argparse.Namespace) -> int:
    from cluster.cmd_cluster import _control
    from proto.flight.dump import SUFFIX

    reply = _control(args.config, {"op": "flight_dump"}, args.timeout)
    out = Path(args.out or f"pdserve-flight-{time.strftime('%Y%m%dT%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    for name, text in sorted(reply["dumps"].items()):
        path = out / f"{name}{SUFFIX}"
        path.write_text(text)
        print(f"pdserve: {name}: {text.count(chr(10)) - 1} entries -> {path}")
    for name, why in sorted(reply.get("missing", {}).items()):
        print(f"pdserve: {name}: no dump ({why})", file=sys.stderr)
    print(f"pdserve: replay them with 'pdserve replay {out}'")
    return 0 if reply["dumps"] else 1


def replay(args: argparse.Namespace) -> int:
    from cluster.flight_replay import replay as replay_dump
    from proto.flight.dump import find, read

    different = 0
    for path in find(args.dump):
        report = replay_dump(read(path), step_limit=args.step_limit)
        print(f"{path}:")
        for line in report.lines():
            print(line)
        different += len(report.different)
    if different:
        print(f"pdserve: {different} requests ended differently in the replay", file=sys.stderr)
        return 1
    return 0


def add_debug_commands(sub) -> None:
    debug = sub.add_parser("debug", help="inspect a running cluster (flight recorder dumps)")
    debug_sub = debug.add_subparsers(dest="debug_command", required=True)
    dump = debug_sub.add_parser(
        "dump", help="write every process's flight recorder (recent messages and state changes per request)",
        description="Fetch the flight recorder of the router and every worker of the cluster 'pdserve up CONFIG' "
        "runs: the last flight_recorder.capacity control messages and state changes of each process, one JSON-lines "
        "file per process. A process also dumps on SIGUSR1 (kill -USR1 PID) and the router when a request outlives "
        "its deadline, into flight_recorder.dump_dir on its node.")
    dump.add_argument("config", help="the YAML given to 'pdserve up'")
    dump.add_argument("--out", help="directory for the files (default ./pdserve-flight-<time>)")
    dump.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the dumps (default 60)")
    dump.set_defaults(func=debug_dump)

    rp = sub.add_parser(
        "replay", help="re-drive a flight recorder dump into in-process twins and compare how each request ended",
        description="Rebuild the dumped worker (prefill, decode or colocated) in this process with the same engine "
        "settings, feed it the recorded commands in their recorded order (and, for a decode worker, its KV as the "
        "record says it arrived or failed), and compare every request's terminal state (and tokens, where greedy or "
        "seeded) with the recorded one. Exit 1 when any request ended differently. Router dumps are summarised.")
    rp.add_argument("dump", help="a *.flight.jsonl file, or a directory of them (what 'pdserve debug dump' wrote)")
    rp.add_argument("--step-limit", type=int, default=20_000,
                    help="engine steps the twin may take waiting for one recorded point (default 20000)")
    rp.set_defaults(func=replay)
