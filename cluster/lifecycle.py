"""One running cluster and everything that keeps it running: the `Cluster` object.

`pdserve up`, `pdserve demo` and `pdserve bench compare` all run a cluster through it, so each
gets the same thing: the cluster's secret (cluster/cluster_secret.py), the actors
(cluster/launcher.py), the state file `down` / `status` / `scale` find it by (and, for a secret
made here, the owner-only file they sign their requests with), the Prometheus targets file, the
pool manager and its control socket
(cluster/pools.py, cluster/control.py), the supervisor that replaces dead workers and, where a
pool asks for it, the autoscaler (cluster/autoscaler.py). `start` brings all of it up (undoing
what it did if a step fails), `serve_until_signal` waits for SIGINT or SIGTERM, `shutdown` ends
all of it once, whatever state it is in.

Signals: a process started in the background by a non-interactive shell (`pdserve up &` in a
script) begins with SIGINT ignored, and Python then installs no KeyboardInterrupt handler for
it; `serve_until_signal` installs its own handlers for both signals, so Ctrl-C, `kill -INT` and
`pdserve down` (SIGTERM) always stop the cluster cleanly.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from cluster import launcher
from cluster.specs import serving_pools
from cluster.worker_launch import worker_host
from configs import ClusterConfig

if TYPE_CHECKING:
    from cluster.control import ControlServer

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:  # an exited child its parent has not reaped yet (a zombie) has stopped too
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def refuse_if_up(config_path: str | Path) -> None:
    """A cluster for this config already runs (its ports are taken): say so before starting anything."""
    existing = launcher.read_state(config_path)
    if existing and pid_alive(existing["pid"]):
        raise RuntimeError(f"a cluster for {config_path} is already up (pid {existing['pid']}); "
                           f"run 'pdserve down {config_path}' first")


class Cluster:
    def __init__(self, config: ClusterConfig, config_path: str | Path, timeout_s: float = 180.0,
                 say: Callable[[str], None] = print) -> None:
        self.config = config
        self.config_path = config_path
        self.timeout_s = timeout_s
        self.say = say
        self.running: launcher.RunningCluster | None = None
        self._files: list[Path] = []
        self._control: ControlServer | None = None
        self._stop_rounds = threading.Event()  # ends the supervisor's and autoscaler's rounds
        self._threads: list[threading.Thread] = []
        self._stopped = threading.Event()  # set by a stop signal

    @property
    def grpc_address(self) -> str:
        if self.running is None:
            raise RuntimeError("the cluster is not running")
        return self.running.grpc_address

    def start(self) -> Cluster:
        from cluster import cluster_secret
        from cluster.autoscaler import Autoscaler
        from cluster.control import ControlServer
        from cluster.pools import PoolManager

        refuse_if_up(self.config_path)
        secret, generated = cluster_secret.resolve(self.config)
        self.running = launcher.up(self.config, timeout_s=self.timeout_s, say=self.say, secret=secret)
        try:
            if generated:  # `status` and `scale` of this user find it there; removed at shutdown
                self._files.append(cluster_secret.write_secret_file(self.config_path, secret))
            self._files.append(launcher.write_state(self.config_path, self.running))
            self._files.append(self._write_targets())
            self.say(f"pdserve: Prometheus targets (file_sd) in {self._files[-1]}")
            pools = PoolManager(self.running, start_timeout_s=self.timeout_s, on_change=self._write_targets)
            # On the internal address (cluster/worker_launch.py worker_host), never a public 0.0.0.0.
            self._control = ControlServer(pools, f"{worker_host(self.config)}:{self.config.router.control_port}",
                                          secret)
            self._control.start()
            self._threads.append(pools.supervise(self._stop_rounds, say=self.say))
            if any(pool.autoscaling is not None for _, pool in serving_pools(self.config)):
                self._threads.append(Autoscaler(pools, say=self.say).run(self._stop_rounds))
        except BaseException:
            self.shutdown()
            raise
        return self

    def serve_until_signal(self) -> None:
        """Blocks until SIGINT or SIGTERM (on the main thread), whatever the signals' state at start."""
        previous = {sig: signal.signal(sig, lambda *_: self._stopped.set()) for sig in STOP_SIGNALS}
        try:
            while not self._stopped.wait(0.5):
                pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def shutdown(self) -> None:
        """Ends everything `start` began, once; safe after a failed or partial start."""
        self._stop_rounds.set()
        if self._control is not None:
            self._control.close()
            self._control = None
        for thread in self._threads:  # a round in progress finishes; shutdown then marks the cluster closed
            thread.join(10)
        self._threads.clear()
        if self.running is not None:
            self.running.shutdown()
            self.running = None
        for path in self._files:
            path.unlink(missing_ok=True)
        self._files.clear()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _write_targets(self) -> Path:
        running = self.running
        assert running is not None
        with running.lock:
            indices = [(slot.role, slot.index) for slot in running.slots.values()]
        return launcher.write_metrics_targets(self.config_path, self.config, indices)
