"""`pdserve bench compare`: the same traffic against several cluster configs, one after another.

For each config: bring the cluster up with the launcher (as `pdserve up` does), run the
BenchPlan against its router (loadgen/runner.py), bring it down (every actor and the embedded
Ray, so nothing is left behind and the next config gets the machine to itself), and write the
result labelled by the config's file name. Then overlay plots of all of them and a table of
each config's metrics with ratios against the first config at the same rate (loadgen/compare.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from loadgen import plot_if_available
from loadgen.compare import comparison_rows, format_table
from loadgen.credentials import NO_AUTH, ClientAuth
from loadgen.results import BenchResult, write_result
from loadgen.runner import BenchPlan, run_bench

if TYPE_CHECKING:
    from configs import ClusterConfig


def target_address(config, grpc_address: str, backend: str) -> str:
    """Where the bench backend reaches the cluster `launcher.up` started."""
    if backend == "grpc":
        return grpc_address
    if config.router.http_port is None:
        raise ValueError("--backend openai needs router.http_port set in every compared config")
    scheme = "https" if config.router.wants_tls else "http"
    return f"{scheme}://{grpc_address.rsplit(':', 1)[0]}:{config.router.http_port}"


def run_compare(config_paths: list[Path], plan: BenchPlan, backend: str, out_dir: Path, timeout_s: float = 300.0,
                progress: bool = True, say: Callable[[str], None] = print,
                auth_for: Callable[[ClusterConfig], ClientAuth] = lambda config: NO_AUTH) -> list[BenchResult]:
    """`auth_for(config)`: what to present to that config's router (cluster/client_auth.py)."""
    from cluster.lifecycle import Cluster
    from configs import load_cluster_config

    configs = [load_cluster_config(p) for p in config_paths]  # every config checked before any cluster starts
    labels = [p.stem for p in config_paths]
    if len(set(labels)) != len(labels):
        raise ValueError(f"config file names must differ (they label the results): {labels}")
    results = []
    for path, config, label in zip(config_paths, configs, labels):
        say(f"== {label}: starting the cluster from {path}")
        # Supervised like `pdserve up` runs it (state file, control socket, supervisor), so
        # `pdserve status` works against it and a worker dying mid-run is replaced.
        with Cluster(config, path, timeout_s=timeout_s, say=say) as cluster:
            result = run_bench(backend, target_address(config, cluster.grpc_address, backend), plan, label,
                               progress=progress, say=say, auth=auth_for(config))
        say(f"== {label}: cluster stopped")
        json_path, _ = write_result(result, out_dir)
        say(f"   wrote {json_path} and its .csv")
        results.append(result)
    for png in plot_if_available(results, out_dir, say=say):
        say(f"   wrote {png}")
    table = format_table(comparison_rows(results))
    (out_dir / "compare.md").write_text(table + "\n")
    say("\n" + table)
    return results
