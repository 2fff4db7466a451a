"""The soak's cluster (benchmarks/soak.py): builtin:tiny 1P2D in float32 as `pdserve up` runs it
(cluster/lifecycle.py's Cluster, with its supervisor), the thread that SIGKILLs its workers, and
the end-of-run reading of what every worker and the router still hold."""

from __future__ import annotations

import os
import random
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from cluster.launcher import RUN_DIR_ENV

ENGINE = {"dtype": "float32", "page_size": 8, "max_num_batched_tokens": 256, "max_num_seqs": 32, "num_pages": 1024}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def soak_config() -> dict:
    """1P2D on loopback, ports free now; every prompt on the prefill worker while it lives."""
    pool = {"num_cpus_per_worker": 0.5, "engine": ENGINE}
    return {
        "model": "builtin:tiny", "mode": "disaggregated",
        "router": {"host": "127.0.0.1", "grpc_port": free_port(), "worker_event_port": free_port(),
                   "control_port": free_port(), "disaggregation": "always", "heartbeat_timeout_s": 2.0,
                   "max_queued_requests": 1024},
        "prefill": {**pool, "num_workers": 1, "base_port": free_port()},
        "decode": {**pool, "num_workers": 2, "base_port": free_port(), "kv_base_port": free_port()},
        "kv_transfer": {"transport": "zmq", "timeout_s": 10.0, "reservation_lease_s": 10.0},
    }


def descends_from_us(pid: int) -> bool:
    """Whether `pid` is a child, grandchild, ... of this process (read from /proc)."""
    me = os.getpid()
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if pid == me:
            return True
    return False


class SoakCluster:
    def __init__(self, work_dir: Path, say=print) -> None:
        from cluster.lifecycle import Cluster
        from configs import load_cluster_config

        self.say = say
        work_dir.mkdir(parents=True, exist_ok=True)
        self.config_path = work_dir / "soak-1p2d.yaml"
        self.config_path.write_text(yaml.safe_dump(soak_config()))
        self._run_dir_before = os.environ.get(RUN_DIR_ENV)
        os.environ[RUN_DIR_ENV] = str(work_dir / "run")  # the state files of this cluster only
        self.cluster = Cluster(load_cluster_config(self.config_path), self.config_path,
                               say=lambda line: say(f"  [cluster] {line}"))

    def __enter__(self) -> SoakCluster:
        return self

    def start(self) -> None:
        """Brings the cluster up (a failed start undoes itself; `__exit__` ends the rest)."""
        self.cluster.start()

    def __exit__(self, *exc) -> None:
        try:
            self.cluster.shutdown()  # the actors and the embedded Ray, whatever state they are in
        finally:
            self._restore_env()

    def _restore_env(self) -> None:
        if self._run_dir_before is None:
            os.environ.pop(RUN_DIR_ENV, None)
        else:
            os.environ[RUN_DIR_ENV] = self._run_dir_before

    @property
    def grpc_address(self) -> str:
        return self.cluster.grpc_address

    def _slots(self) -> dict:
        running = self.cluster.running
        assert running is not None
        with running.lock:  # the supervisor changes them under it
            return dict(running.slots)

    def worker_pid(self, worker_id: str) -> int | None:
        import ray

        slot = self._slots().get(worker_id)
        try:
            return None if slot is None else ray.get(slot.actor.state.remote(), timeout=10)["pid"]
        except Exception:  # noqa: BLE001 - dead or not up yet
            return None

    def _router(self) -> Any:
        """The RouterActor handle."""
        running = self.cluster.running
        assert running is not None
        return running.router

    def healthy(self, worker_id: str) -> bool:
        import ray

        return bool(ray.get(self._router().worker_healthy.remote(worker_id), timeout=30))

    def start_killing(self, every_s: tuple[float, float], until_s: float, rng: random.Random) -> Killer:
        return Killer(self, every_s, until_s, rng)

    def held(self) -> tuple[dict[str, int], dict[str, list[str]], dict[str, int]]:
        """(worker -> KV pages referenced, holder -> request ids held, router count -> value)."""
        import ray

        slots = self._slots()
        pages = dict(zip(slots, ray.get([s.actor.page_stats.remote() for s in slots.values()], timeout=30)))
        ids = dict(zip(slots, ray.get([s.actor.held_request_ids.remote() for s in slots.values()], timeout=30)))
        router: dict[str, Any] = ray.get(self._router().held.remote(), timeout=30)
        ids["router"] = router.pop("request_ids")
        return {w: p["referenced"] for w, p in pages.items()}, ids, router

    def settle(self, within_s: float) -> tuple[dict[str, int], dict[str, list[str]], dict[str, int]]:
        """What is still held `within_s` after the last stream (returns earlier once nothing is)."""
        deadline = time.monotonic() + within_s
        while True:
            pages, ids, counts = self.held()
            if (not any(pages.values()) and not any(ids.values()) and not any(counts.values())) \
                    or time.monotonic() >= deadline:
                return pages, ids, counts
            time.sleep(0.1)


class Killer:
    """A thread that SIGKILLs one random worker (a random role, then one of its workers) every
    `every_s` (uniform) until `until_s` after its start, and after each kill waits for the
    supervisor's replacement: a new pid at the same worker id, healthy at the router."""

    def __init__(self, cluster: SoakCluster, every_s: tuple[float, float], until_s: float, rng: random.Random,
                 replace_timeout_s: float = 120.0) -> None:
        self.cluster, self.every_s, self.rng = cluster, every_s, rng
        self.replace_timeout_s = replace_timeout_s
        self.kills: list[dict] = []
        self._stop = threading.Event()
        self._start = time.monotonic()
        self._until = self._start + until_s
        self._thread = threading.Thread(target=self._run, name="soak-killer", daemon=True)
        if every_s[1] > 0:
            self._thread.start()

    def finish(self) -> list[dict]:
        """No more kills; waits for the replacement in progress. Returns one record per kill."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.replace_timeout_s + 30)
        return self.kills

    def _run(self) -> None:
        next_at = self._start + self.rng.uniform(*self.every_s)
        while next_at < self._until and not self._stop.wait(max(0.0, next_at - time.monotonic())):
            attempted = time.monotonic()
            workers = sorted(self.cluster._slots())
            role = self.rng.choice(sorted({w.split("-")[0] for w in workers}))  # a role, then one of its workers
            self._kill(self.rng.choice([w for w in workers if w.startswith(f"{role}-")]))
            next_at = attempted + self.rng.uniform(*self.every_s)

    def _kill(self, worker_id: str) -> None:
        pid = self.cluster.worker_pid(worker_id)
        if pid is None or not descends_from_us(pid):  # only this cluster's own worker processes
            self.cluster.say(f"soak: {worker_id} has no pid of ours ({pid}); not killed")
            return
        at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        record = {"worker_id": worker_id, "role": worker_id.split("-")[0], "pid": pid, "at": at,
                  "at_s": at - self._start, "replaced_s": None}
        self.kills.append(record)
        self.cluster.say(f"soak: SIGKILL {worker_id} (pid {pid}) at {record['at_s']:.0f} s")
        while time.monotonic() - at < self.replace_timeout_s:
            new = self.cluster.worker_pid(worker_id)
            if new is not None and new != pid and self.cluster.healthy(worker_id):
                record["replaced_s"] = time.monotonic() - at
                self.cluster.say(f"soak: {worker_id} replaced (pid {new}) in {record['replaced_s']:.1f} s")
                return
            time.sleep(0.25)
        self.cluster.say(f"soak: {worker_id} not replaced within {self.replace_timeout_s:.0f} s")
