"""The whole engine on CUDA (Triton kernels, picked by attention_backend auto) against Hugging
Face greedy on `builtin:small`: token for token in float32; in bfloat16 up to the first step
where Hugging Face's own top two tokens are nearly tied (two bf16 implementations may order a
near tie either way, and everything after it differs legitimately).

Ran and passed on an NVIDIA H200 on 2026-12-04 (docs/benchmarks.md, "The GPU check"); skipped
with the reason where there is no CUDA.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.gpu_env import requires_compiled_triton

pytestmark = [pytest.mark.gpu, requires_compiled_triton]

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import numpy as np\n" * 20]  # the last: ~120 tokens
MAX_TOKENS = 24
NEAR_TIE = 0.05  # logit gap (nats) under which bf16 rounding may pick either token


def hf_greedy_with_margins(model, ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and, per step, the gap between the best and second-best logit."""
    prompt = torch.tensor([ids], device=model.device)
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=None, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, prompt.shape[1]:].tolist()
    margins = [float(step[0].float().topk(2).values.diff().abs()) for step in out.logits]
    return tokens, margins


def first_difference(got: list[int], want: list[int], margins: list[float]) -> str:
    """Where two greedy runs part, with Hugging Face's top-two logit gap at each step up to there:
    the failure message, so one run on a GPU tells a near tie from a wrong kernel."""
    step = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    gaps = ", ".join(f"{gap:.3f}" for gap in margins[: step + 1])
    return f"first differs at step {step}; HF's top-two logit gaps through it: [{gaps}]"


def decisive_prefix(tokens: list[int], margins: list[float]) -> list[int]:
    """The tokens before the first near tie."""
    for i, gap in enumerate(margins):
        if gap < NEAR_TIE:
            return tokens[:i]
    return tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llm_on_cuda_matches_hf_greedy(dtype):
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams
    from engine.model.builtin import ensure_builtin

    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 oracle is true float32
    model_dir = ensure_builtin("small")
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).cuda().eval()
    with LLM("builtin:small", device="cuda", dtype=dtype, kv_cache_memory_bytes=1 << 30) as llm:
        assert llm.engine.model.backend.name == "triton"
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        for out in outs:
            expected, margins = hf_greedy_with_margins(hf, out.prompt_token_ids, MAX_TOKENS)
            if dtype == "float32":
                assert out.token_ids == expected, first_difference(out.token_ids, expected, margins)
            else:
                prefix = decisive_prefix(expected, margins)
                assert out.token_ids[: len(prefix)] == prefix, first_difference(out.token_ids, expected, margins)
