"""1P1D on one GPU: a prefill and a decode worker (in one process, tests/local_cluster.py, the
specs `pdserve up` builds) whose KV caches live in CUDA memory, KV moved over the ZMQ transport
(frames staged through host memory: engine/kv_transfer/frames.py), behind the real router and
gRPC. Every output must equal the colocated engine's on the same GPU and dtype.

Ran and passed on an NVIDIA H200 on 2026-12-04 (docs/benchmarks.md, "The GPU check"); skipped
with the reason where there is no CUDA.
"""

from __future__ import annotations

import pytest

from tests.gpu.gpu_env import requires_compiled_triton

pytestmark = [pytest.mark.gpu, pytest.mark.cluster, requires_compiled_triton]

PROMPTS = [[1] + list(range(100, 100 + n)) for n in (3, 40, 200, 700)]  # one to many pages
MAX_TOKENS = 16


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_prefill_one_decode_on_cuda_equals_colocated(dtype):
    from configs import EngineConfig
    from engine import LLM, SamplingParams
    from engine.model.builtin import ensure_builtin
    from proto import pdserve_pb2 as pb
    from tests.local_cluster import LocalCluster

    engine = EngineConfig(model="builtin:small", device="cuda", dtype=dtype, page_size=16,
                          kv_cache_memory_bytes=1 << 30)
    with LLM(**engine.model_dump()) as llm:
        expected = [out.token_ids for out in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS,
                                                                                     ignore_eos=True))]
    cluster = LocalCluster(ensure_builtin("small"), "disaggregated", engine, ready_timeout_s=300)
    try:
        for prompt, want in zip(PROMPTS, expected):
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                     sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
            got = [t for resp in cluster.stub.Generate(req, timeout=120) for t in resp.token_ids]
            assert got == want
        cluster.wait_pages_free()
    finally:
        cluster.close()
