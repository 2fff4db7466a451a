"""A serving process's share of the cores it runs on: its niceness, and its compute threads.

`lower_priority` is called at the start of the router actor (cluster/actors.py) with
`router.nice`, and of each worker actor with its pool's `nice`; `compute_threads` sets a
worker's intra-op threads to its pool's `num_threads_per_worker`.

Why the router is niced: on one node the
router, the client and the worker's compute threads share the cores; the worker's threads meet
at a barrier at the end of every kernel, so a router thread that preempts one of them idles the
other too. At nice 10 the router still gets its share (CFS weights it at ~1/9 of a nice-0
thread, and it needs ~10% of a core at full load), but it waits for a compute thread's time
slice rather than cutting into it. `benchmarks/vs_vllm.py`'s served quick burst on 2 cores,
five alternating pairs: 4.25-4.68 against 4.17-4.45 req/s (every pair higher), shared prefixes
3.86-4.62 against 3.71-4.21 (four of five).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def lower_priority(nice: int) -> int:
    """Raises the niceness of every thread of this process (and of threads it starts later,
    which inherit the caller's) to at least `nice`; returns the process's niceness after.
    0 leaves it. Raising one's niceness needs no privilege; where the OS refuses, logs why."""
    if nice <= 0:
        return os.getpriority(os.PRIO_PROCESS, 0)
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]  # Linux: niceness is per thread
    except OSError:
        threads = [0]
    for tid in threads:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError as exc:  # a thread that ended meanwhile, or a sandbox that refuses
            log.debug("could not renice thread %d to %d: %s", tid, nice, exc)
    return os.getpriority(os.PRIO_PROCESS, 0)


def compute_threads(threads: int | None) -> int:
    """Sets torch's intra-op thread count to `threads` (None leaves what Ray's OMP_NUM_THREADS
    gave: the worker's CPUs); returns the count after. Called before the engine runs a kernel."""
    import torch

    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return torch.get_num_threads()
