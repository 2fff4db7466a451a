"""Shared test fixtures: the built-in tiny model and its Hugging Face twin (helpers: tests/helpers.py).

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
# dtype `auto` means bfloat16 on CPUs with native bf16; the oracle (HF greedy) is float32, so
# the suite, and every worker process it starts, sees a CPU without it.
os.environ.setdefault("PDSERVE_CPU_NATIVE_BF16", "0")

import pytest  # noqa: E402
import torch  # noqa: E402  (importing torch does not load triton)

# Without a GPU, Triton kernels run in the interpreter, which must be chosen before triton
# loads; with one, tests/gpu/ runs them compiled (scripts/gpu_check.sh sets 0 explicitly too).
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

from engine.model.builtin import ensure_builtin  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip, saying why, where CUDA is missing (tests/gpu/ on a CPU machine)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: no GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return ensure_builtin("tiny")


@pytest.fixture(scope="session")
def hf_tiny(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def loopy_dir(tiny_dir, tmp_path_factory) -> Path:
    """builtin:tiny made repetitive (tests/helpers.py): speculative decoding's test model."""
    from tests.helpers import write_loopy_model

    dst = tmp_path_factory.mktemp("loopy") / "model"
    write_loopy_model(tiny_dir, dst)
    return dst


@pytest.fixture(scope="session")
def loopy_draft_dir(loopy_dir, tmp_path_factory) -> Path:
    """The loopy model cut to its first layer: a draft for it (same vocabulary, right only sometimes)."""
    from tests.helpers import write_truncated_model

    dst = tmp_path_factory.mktemp("loopy-draft") / "model"
    write_truncated_model(loopy_dir, dst, num_layers=1)
    return dst


@pytest.fixture(scope="session")
def lm_head_heads_dir(tiny_dir, tmp_path_factory) -> Path:
    """Three Medusa heads for builtin:tiny's geometry, each its output layer behind identity blocks
    (tests/helpers.py): 'the token just produced comes again', right sometimes on the loopy model."""
    from tests.helpers import medusa_tensors_from_lm_head, write_medusa_heads

    return write_medusa_heads(tmp_path_factory.mktemp("heads"), medusa_tensors_from_lm_head(tiny_dir, 3), 3)


@pytest.fixture(scope="session")
def hf_loopy(loopy_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(loopy_dir), dtype=torch.float32).eval()
