"""The load generator behind `pdserve bench`: seeded workloads and arrival times (workloads.py),
streaming clients for gRPC and OpenAI HTTP (client.py), the run loop (runner.py), latency and
SLO metrics (metrics.py), results as JSON/CSV (results.py), ratio tables (compare.py) and PNG
charts (plots.py, needing the `plots` extra). It talks to a cluster only over the wire, so it
imports nothing of pdserve but `proto`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def plot_if_available(results: list, out_dir: Path, prefix: str = "", say: Callable[[str], None] = print) -> list[Path]:
    """PNG charts of `results` (loadgen/plots.py), or none with a note when matplotlib is missing:
    a serving install need not carry a plotting library to run a benchmark."""
    try:
        from loadgen.plots import plot_results
    except ImportError:
        say("plots skipped: matplotlib is not installed (pip install 'pdserve[plots]')")
        return []
    return plot_results(results, out_dir, prefix)
