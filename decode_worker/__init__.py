"""Decode worker: reserves pages, receives KV, runs the continuously batched decode loop; also the colocated role."""
