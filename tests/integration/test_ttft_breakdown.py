"""A request's TTFT in stages (router/ttft_stages.py) served end to end, in one process: the
stages in every Usage sum to its ttft_s within 1 ms (colocated, local and remote placements),
a delay injected into the KV transfer shows in the hand-off's transfer stage and nowhere else,
and the router's stage histogram counts what the usages said."""

from __future__ import annotations

import time

import pytest

from configs import EngineConfig
from proto import pdserve_pb2 as pb
from tests.helpers import hf_greedy
from tests.local_cluster import LocalCluster

pytestmark = pytest.mark.cluster

ENGINE = EngineConfig(model="builtin:tiny", page_size=8, max_num_batched_tokens=64, max_num_seqs=16)
DELAY_S = 0.4


def final_usage(cluster: LocalCluster, prompt: list[int], max_tokens: int = 6) -> tuple[list[int], pb.Usage]:
    ids, usage = [], None
    for resp in cluster.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
            max_tokens=max_tokens, ignore_eos=True)), timeout=60):
        ids += resp.token_ids
        if resp.HasField("usage"):
            usage = resp.usage
    return ids, usage


def stage_sum(usage: pb.Usage) -> float:
    b = usage.ttft_breakdown
    return b.queued_s + b.prefill_s + b.transfer_s + b.decode_wait_s


def stage_counts(cluster: LocalCluster) -> dict[str, float]:
    return {s.labels["stage"]: s.value for m in cluster.router.metrics.stages.collect() for s in m.samples
            if s.name.endswith("_count")}


@pytest.mark.parametrize(("mode", "disaggregation"), [("colocated", None), ("disaggregated", "never")])
def test_stages_sum_to_the_ttft_where_the_prompt_is_computed_on_the_decoding_worker(tiny_dir, hf_tiny, mode,
                                                                                 disaggregation):
    c = LocalCluster(tiny_dir, mode, ENGINE, **({"disaggregation": disaggregation} if disaggregation else {}))
    try:
        for prompt in ([0, 5, 6, 7], list(range(10, 60))):
            ids, usage = final_usage(c, prompt)
            assert ids == hf_greedy(hf_tiny, prompt, 6)[0]
            assert usage.HasField("ttft_breakdown") and not usage.HasField("kv_handoff")
            assert abs(stage_sum(usage) - usage.ttft_s) < 1e-3
            assert usage.ttft_breakdown.prefill_s > 0 and usage.ttft_breakdown.transfer_s == 0.0
        assert stage_counts(c) == {"queued": 2.0, "prefill": 2.0}
    finally:
        c.close()


def test_a_slow_kv_transfer_shows_in_the_transfer_stage_only(tiny_dir, hf_tiny):
    c = LocalCluster(tiny_dir, "disaggregated", ENGINE, disaggregation="always")
    try:
        prompt = list(range(10, 60))
        _, usage = final_usage(c, prompt)  # warm: the link is up and the kernels are built
        fast = usage.kv_handoff.transfer_s
        prefill = next(h for h in c.hosts if h.role == "prefill")
        links = prefill._role.links
        make_sender = links.sender

        def slow_sender(address: str):
            sender = make_sender(address)
            if not getattr(sender, "slowed_by_test", False):
                finish = sender.finish

                def slow_finish(*args, **kwargs):  # the last frame leaves DELAY_S late
                    time.sleep(DELAY_S)
                    return finish(*args, **kwargs)

                sender.finish, sender.slowed_by_test = slow_finish, True
            return sender

        links.sender = slow_sender
        ids, usage = final_usage(c, [0, *prompt[1:]])
        assert ids == hf_greedy(hf_tiny, [0, *prompt[1:]], 6)[0]
        assert usage.placement == "remote" and abs(stage_sum(usage) - usage.ttft_s) < 1e-3
        b, h = usage.ttft_breakdown, usage.kv_handoff
        assert h.transfer_s >= DELAY_S > fast  # the delay is in the transfer stage ...
        assert b.queued_s < DELAY_S and b.prefill_s < DELAY_S and h.decode_wait_s < DELAY_S  # ... and only there
        assert b.transfer_s == 0.0 and b.decode_wait_s == 0.0  # the first token never waits for the KV
        assert stage_counts(c) == {"queued": 2.0, "prefill": 2.0, "transfer": 2.0, "decode_wait": 2.0}
        c.wait_pages_free()
    finally:
        c.close()
