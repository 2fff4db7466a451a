"""`pdserve up`, `down`, `status` and `scale`: a cluster's lifecycle from the command line (the
running cluster itself is cluster/lifecycle.py's `Cluster`; status and scale talk to its `up`
process over the control socket, cluster/control.py)."""

from __future__ import annotations

import argparse
import os
import sys
import time


def up(args: argparse.Namespace) -> int:
    from cluster.lifecycle import Cluster
    from configs import load_cluster_config

    if args.dry_run:
        from cluster.dry_run import plan

        for line in plan(load_cluster_config(args.config)):
            say(line)
        say(f"pdserve: dry run of {args.config}: every spec built, nothing started")
        return 0
    cluster = Cluster(load_cluster_config(args.config), args.config, timeout_s=args.timeout, say=say).start()
    try:
        say(f"pdserve: cluster up, gRPC at {cluster.grpc_address}; Ctrl-C or 'pdserve down {args.config}' stops it")
        cluster.serve_until_signal()
        say("pdserve: stopping the cluster ...")
    finally:
        cluster.shutdown()
    say("pdserve: stopped")
    return 0


def say(line: str) -> None:
    print(line, flush=True)


def down(args: argparse.Namespace) -> int:
    import signal

    from cluster import launcher
    from cluster.lifecycle import pid_alive

    state = launcher.read_state(args.config)
    if state is None or not pid_alive(state["pid"]):
        launcher.state_file(args.config).unlink(missing_ok=True)
        print(f"pdserve: no running cluster for {args.config}", file=sys.stderr)
        return 1
    os.kill(state["pid"], signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while pid_alive(state["pid"]):
        if time.monotonic() > deadline:
            print(f"pdserve: cluster (pid {state['pid']}) still stopping after {args.timeout:.0f} s", file=sys.stderr)
            return 1
        time.sleep(0.2)
    print("pdserve: cluster stopped")
    return 0


def _control(config_path: str, request: dict, timeout_s: float) -> dict:
    """One request to the `up` process of CONFIG's cluster; exits with the reason on failure."""
    from cluster import cluster_secret, launcher
    from cluster.control import control_request
    from cluster.lifecycle import pid_alive
    from configs import load_cluster_config

    config = load_cluster_config(config_path)
    state = launcher.read_state(config_path)
    if state is None or not pid_alive(state["pid"]):
        raise SystemExit(f"pdserve: no running cluster for {config_path} (start it with 'pdserve up {config_path}')")
    host = config.router.host if config.router.host != "0.0.0.0" else "127.0.0.1"
    address = state.get("control_address") or f"{host}:{config.router.control_port}"  # `up` wrote where it listens
    try:
        reply = control_request(address, request, timeout_s, cluster_secret.for_client(config, config_path))
    except (TimeoutError, PermissionError, ValueError) as exc:
        raise SystemExit(f"pdserve: {exc}") from None
    if not reply.get("ok"):
        raise SystemExit(f"pdserve: {reply.get('error')}")
    return reply


def status(args: argparse.Namespace) -> int:
    import json

    status = _control(args.config, {"op": "status"}, args.timeout)["status"]
    if args.json:
        print(json.dumps(status, indent=1))
        return 0
    print(f"{status['mode']} cluster, gRPC {status['grpc_address']}, "
          f"{'ready' if status['ready'] else 'NOT READY'}, {status['requests_in_flight']} requests in flight")
    for node in status["nodes"]:
        resources = ", ".join(f"{k} {v:g}" for k, v in sorted(node["resources"].items())
                              if not k.startswith(("node:", "memory", "object_store")))
        print(f"  node {node['node_id'][:8]} {node['address']}: {resources}")
    for role, pool in status["pools"].items():
        print(f"  {role}: {pool['workers']} workers (target {pool['target']}, max {pool['max_workers']}), "
              f"TP={pool['tensor_parallel_size']} PP={pool['pipeline_parallel_size']}")
        if pool.get("autoscaling"):
            a = pool["autoscaling"]
            print(f"    autoscaler: wants {a['wanted']} ({a['why']})")
    print(f"  {'worker':<12} {'role':<9} {'node':<10} {'health':<9} {'in flight':>9} {'running':>7} {'waiting':>7} "
          f"{'queued tok':>10} {'KV used/total':>14}  placement")
    for w in status["workers"]:
        health = "draining" if w.get("draining") else "healthy" if w.get("healthy") else "DOWN"
        pages = w.get("kv_pages") or {}
        kv = f"{pages.get('referenced', '?')}/{pages.get('num_pages', '?')}"
        placement = "-"
        if w.get("placement"):
            nodes = {n[:8] for n in w["placement"]["bundle_nodes"]}
            placement = f"{w['placement']['strategy']} x{len(w['placement']['bundles'])} on {', '.join(sorted(nodes))}"
        print(f"  {w['worker_id']:<12} {w.get('role', '?'):<9} {str(w.get('node_id', '?'))[:8]:<10} {health:<9} "
              f"{w.get('in_flight', 0):>9} "
              f"{w.get('running', '?'):>7} {w.get('waiting', '?'):>7} {str(w.get('queued_tokens', '?')):>10} "
              f"{kv:>14}  {placement}" + (f"  error: {w['error']}" if w.get("error") else ""))
    flips = [w for w in status["workers"] if w.get("last_flip")]
    if flips:
        print("  Role flips (the last of each worker):")
    for w in flips:
        flip = w["last_flip"]
        print(f"    {w['worker_id']} -> {flip['role']} by {flip['by']}, "
              f"{time.time() - flip['at']:.0f} s ago: {flip['reason']}")
    links = [(w["worker_id"], dst, link) for w in status["workers"] for dst, link in (w.get("kv_links") or {}).items()]
    if links:
        print("  KV links:")
    for src, dst, link in links:
        if link["up"]:
            state = "up"
        else:
            state = f"DOWN ({link['error']})" + (f"; KV goes over the fallback {link['route']}" if link["fallback"]
                                                 else "; no route: not used")
        print(f"    {src} -> {dst}: {state}")
    return 0


def role(args: argparse.Namespace) -> int:
    flip = _control(args.config, {"op": "set_role", "worker": args.worker, "role": args.new_role,
                                  "reason": args.reason}, args.timeout)["flip"]
    print(f"pdserve: {flip['worker_id']} now serves {flip['role']} (was {flip['old']}); what it held of "
          f"{flip['old']} finishes there")
    return 0


def scale(args: argparse.Namespace) -> int:
    sizes = {role: n for role, n in (("prefill", args.prefill), ("decode", args.decode),
                                     ("colocated", args.colocated)) if n is not None}
    if not sizes:
        raise SystemExit("pdserve: give at least one of --prefill N, --decode N, --colocated N")
    reply = _control(args.config, {"op": "scale", "sizes": sizes, "drain_timeout_s": args.drain_timeout},
                     args.drain_timeout * len(sizes) + args.timeout)
    for change in reply["changes"]:
        removed = [r["worker_id"] + (f" ({r['cut_off_requests']} requests cut off at the drain timeout)"
                                     if r["cut_off_requests"] else "") for r in change["removed"]]
        starting = change.get("starting", [])
        serving = [w for w in change["added"] if w not in starting]
        print(f"pdserve: {change['role']}: {change['size']} workers"
              + (f"; added {', '.join(serving)} (serving)" if serving else "")
              + (f"; added {', '.join(starting)} (still starting: no heartbeat yet, see pdserve status)"
                 if starting else "")
              + (f"; drained and removed {', '.join(removed)}" if removed else "")
              + ("" if change["added"] or removed else " (unchanged)"))
    return 0
