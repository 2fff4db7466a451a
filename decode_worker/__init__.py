"""Decode worker: reserves pages, receives KV, runs the continuously batched decode loop (arrives with the disaggregation issue)."""
