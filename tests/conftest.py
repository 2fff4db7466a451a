"""Shared test fixtures: the built-in tiny model, a Hugging Face reference, page accounting.

Built-in models are cached under the repo's .cache/ (git-ignored) unless PDSERVE_CACHE says
otherwise, so the suite builds each one once per machine.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("PDSERVE_CACHE", str(REPO / ".cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.builtin_models import ensure_builtin  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return ensure_builtin("tiny")


@pytest.fixture(scope="session")
def hf_tiny(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Hugging Face greedy generate (EOS ignored): generated ids and each one's log-probability."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=None, output_logits=True, return_dict_in_generate=True,
        )
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def assert_no_page_leak(engine) -> None:
    """Every page is free or held only by the prefix cache."""
    stats = engine.page_stats()
    assert stats["referenced"] == 0, f"pages still referenced after all requests finished: {stats}"
    assert stats["free"] == stats["num_pages"], stats
