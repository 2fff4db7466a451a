"""Engine settings: which model, how much memory for the paged KV cache, and batch budgets.

Read by engine.LLMEngine (and later by each prefill/decode worker). Frozen and strict: an
unknown key or a wrong type fails at load with the key named, never later in the step loop.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class EngineSettings(BaseModel):
    """Everything about one engine except which model it serves (a cluster's pools share the
    model and differ in these)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    # auto: bfloat16 on GPU and on CPUs with native bf16 (AVX512-BF16, AMX), float32 elsewhere
    # (engine/model/compute_dtype.py); bf16 on an AVX2-only CPU is about 4x slower than float32.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "cpu"
    page_size: int = Field(16, ge=1, le=1024, description="tokens per KV page")
    # The KV cache is sized from a byte budget (the way users think about memory); num_pages
    # overrides it when a test wants an exact, tiny cache to force preemption.
    kv_cache_memory_bytes: int = Field(256 * 1024 * 1024, ge=1)
    num_pages: int | None = Field(None, ge=1)
    max_num_seqs: int = Field(64, ge=1, description="sequences in one step's batch at most")
    max_num_batched_tokens: int = Field(2048, ge=1, description="per-step token budget (chunked prefill)")
    enable_prefix_caching: bool = True
    attention_backend: Literal["auto", "cpu", "torch", "triton"] = "auto"
    max_model_len: int | None = Field(None, ge=1, description="defaults to the model's context length")
    cache_dir: str | None = Field(None, description="where built-in models are written; default ~/.cache/pdserve")
    # One worker spans tensor_parallel_size x pipeline_parallel_size processes (engine/parallel/layout.py);
    # the model must split evenly (heads, kv heads, MLP width by TP; at least one layer per stage).
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="shards per layer (attention heads, MLP)")
    pipeline_parallel_size: int = Field(1, ge=1, le=64, description="stages, each a contiguous run of layers")

    @property
    def world_size(self) -> int:
        """Processes one engine spans."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @model_validator(mode="after")
    def _check_budgets(self) -> EngineSettings:
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Otherwise the sequences at the tail of a full batch never get a decode token.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence needs a token each step"
            )
        return self


class EngineConfig(EngineSettings):
    model: str = Field("builtin:tiny", description="'builtin:tiny', 'builtin:small' or a local HF directory")
