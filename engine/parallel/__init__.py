"""Tensor and pipeline parallelism inside one worker: which heads and layers a rank holds and
its process groups (layout.py), the TCP store they rendezvous on, listening on its configured
host only (tcp_store.py), building one rank's model and KV cache (model_shard.py), the driver
that runs a step across the group (shard_executor.py), the follower loop of every other rank
(shard_follower.py), and the driver's view of the sharded KV cache (sharded_kv_cache.py)."""
