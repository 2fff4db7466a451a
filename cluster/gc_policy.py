"""Python's cyclic garbage collector, set for a serving process: a worker, a follower rank of a
sharded worker, or the router.

Called once by each Ray actor (cluster/actors.py, cluster/shard_actor.py) as it starts, before
its engine or router exists. A serving step allocates thousands of short-lived containers (the
scheduled batch, each sequence's output, token events) that reference counting frees at once;
the default threshold (a collection of the youngest generation every 700 net container
allocations) still ran ~820 collections during one offline burst (vs_vllm.py's: 32 x 512-token
prompts, 128 tokens out, builtin:small bf16, 2 cores), ~160 ms of a 5.7 s run, each on the
step's own thread while the other compute thread waited. A threshold of 100,000 left 5
collections and raised the burst from 5.46-5.63 to 5.56-5.82 req/s (two runs each way,
alternating; `benchmarks/engine_burst.py` with the threshold set for the whole process).
Served (vs_vllm.py's quick burst through a colocated cluster, two runs each way) it was
4.84-5.07 against 4.87 req/s: inside that measurement's run-to-run spread, which is wider than
the gain. Cycles are still collected, only less often; they are rare here (engine objects live
for the process), so memory does not grow with it.
"""

from __future__ import annotations

import gc

# Net container allocations between collections of the youngest generation (Python's default:
# 700); the older generations keep their default ratios.
SERVING_GEN0_THRESHOLD = 100_000


def tune_for_serving() -> None:
    """Collects the start-up garbage once, then collects the youngest generation only every
    SERVING_GEN0_THRESHOLD net allocations."""
    gc.collect()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(SERVING_GEN0_THRESHOLD, gen1, gen2)
