"""cluster/cpu_priority.py: the router's threads, those running and those it starts later, yield
the cores to workers; each case runs in a child process, since niceness cannot be lowered back."""

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from configs.cluster import RouterConfig

REPO = Path(__file__).resolve().parents[2]

_CHILD = """
import os, threading
from cluster.cpu_priority import lower_priority
before = os.getpriority(os.PRIO_PROCESS, 0)
ready, done, seen = threading.Event(), threading.Event(), {}
def early():  # running before the call: reniced in place
    seen["early_tid"] = threading.get_native_id(); ready.set(); done.wait(10)
t = threading.Thread(target=early); t.start(); ready.wait(10)
after = lower_priority(int(os.environ["NICE"]))
seen["early"] = os.getpriority(os.PRIO_PROCESS, seen["early_tid"])
def late():  # started after the call: inherits it
    seen["late"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
u = threading.Thread(target=late); u.start(); u.join(); done.set(); t.join()
print(before, after, seen["early"], seen["late"])
"""


def _run(nice: int) -> list[int]:
    out = subprocess.run([sys.executable, "-c", _CHILD], env={"NICE": str(nice), "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=60, check=True)
    return [int(x) for x in out.stdout.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_every_thread_of_the_process_runs_at_the_routers_niceness():
    before, after, early, late = _run(7)
    if before >= 7:
        pytest.skip(f"this test process already runs at niceness {before}")
    assert (after, early, late) == (7, 7, 7)


def test_zero_leaves_the_niceness_as_it_was():
    before, after, early, late = _run(0)
    assert after == early == late == before


def test_router_nice_is_a_niceness():
    assert RouterConfig().nice == 10
    for bad in (-1, 20):
        with pytest.raises(ValidationError, match="nice"):
            RouterConfig(nice=bad)


def test_a_pools_threads_and_niceness_reach_its_workers_spec():
    """num_threads_per_worker / nice (configs/cluster.py) travel in the WorkerSpec the actor
    applies (cluster/actors.py); out-of-range values are config errors naming the key."""
    from cluster.cluster_secret import ClusterSecret
    from cluster.specs import worker_spec
    from configs.cluster import ClusterConfig

    def config_with(**prefill) -> ClusterConfig:
        return ClusterConfig.model_validate({
            "model": "builtin:tiny", "prefill": {"base_port": 52100, **prefill},
            "decode": {"base_port": 52200, "kv_base_port": 52400}})

    config = config_with(num_threads_per_worker=2, nice=15)
    secret = ClusterSecret.generate()
    prefill = worker_spec(config, "prefill", 0, "127.0.0.1", "127.0.0.1", secret)
    decode = worker_spec(config, "decode", 0, "127.0.0.1", "127.0.0.1", secret)
    assert (prefill.num_threads, prefill.nice) == (2, 15) and (decode.num_threads, decode.nice) == (None, 0)
    for bad in ({"nice": 20}, {"num_threads_per_worker": 0}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            config_with(**bad)


def test_compute_threads_sets_torchs_intra_op_threads():
    out = subprocess.run([sys.executable, "-c", "from cluster.cpu_priority import compute_threads as c; "
                          "n = c(None); print(n, c(1), c(3))"], env={"PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=120, check=True)
    unset, one, three = (int(x) for x in out.stdout.split())
    assert unset >= 1 and (one, three) == (1, 3)
