"""Prefill worker: admits prompts, runs chunked prefill, sends the first token, ships KV to decode."""
