"""A Usage's stage messages (TtftBreakdown, KvHandoff: proto/pdserve.proto) as plain dicts.

Where the stages leave the protobuf world: the OpenAI front door puts them in its usage object
(router/openai_http.py) and `pdserve bench` keeps them per request (loadgen/client.py).
"""

from __future__ import annotations


def stage_seconds(message) -> dict[str, float]:
    """{field name: seconds} for every field of `message`, zeros included (a stage that took no
    time is still a stage)."""
    return {f.name: float(getattr(message, f.name)) for f in message.DESCRIPTOR.fields}


def usage_stages(usage) -> dict[str, dict[str, float]]:
    """{"ttft_breakdown": ..., "kv_handoff": ...} for the ones the Usage carries."""
    return {name: stage_seconds(getattr(usage, name)) for name in ("ttft_breakdown", "kv_handoff")
            if usage.HasField(name)}


# The request stages one name each, in the order they happen: the TTFT's two (its transfer and
# decode wait are 0 by design, router/ttft_stages.py) and the remote hand-off's two.
STAGES = (("queued", "ttft_breakdown", "queued_s"), ("prefill", "ttft_breakdown", "prefill_s"),
          ("transfer", "kv_handoff", "transfer_s"), ("decode_wait", "kv_handoff", "decode_wait_s"))


def request_stages(stages: dict[str, dict[str, float]]) -> dict[str, float]:
    """usage_stages' (or the OpenAI usage object's) nested form -> {stage: seconds} for the
    stages present: what the router's stage histogram observes and `pdserve bench` reports."""
    return {stage: stages[group][field] for stage, group, field in STAGES
            if group in stages and field in stages[group]}
