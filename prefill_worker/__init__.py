"""Prefill worker: admits prompts, runs chunked prefill, ships KV to decode (arrives with the disaggregation issue)."""
