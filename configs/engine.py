"""Engine settings: which model, how much memory for the paged KV cache, and batch budgets.

Read by engine.LLMEngine (and later by each prefill/decode worker). Frozen and strict: an
unknown key or a wrong type fails at load with the key named, never later in the step loop.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# engine/spec/ builds a proposer for each but "none". "prompt_lookup+draft": prompt lookup where it
# finds a match, the draft model where it finds none (engine/spec/fallback_proposer.py).
SPECULATIVE_METHODS = ("none", "prompt_lookup", "draft", "medusa", "prompt_lookup+draft")
MAX_SPECULATIVE_TOKENS = 16  # per step per sequence, for the pool default and for a request alike


class SpeculativeConfig(BaseModel):
    """Speculative decoding for a pool's engines (engine/spec/): each decoding sequence may
    compute up to `num_tokens` proposed tokens after its last one, verified by the same step.
    A request may override `method` and `num_tokens` (SamplingParams.speculative_method /
    num_speculative_tokens)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    method: Literal["none", "prompt_lookup", "draft", "medusa", "prompt_lookup+draft"] = "none"
    num_tokens: int = Field(4, ge=1, le=MAX_SPECULATIVE_TOKENS, description="proposed tokens per step, at most")
    # prompt_lookup: match the last n tokens (n from ngram_max down to ngram_min) against the
    # prompt and output so far; propose what followed the most recent earlier match.
    ngram_min: int = Field(1, ge=1, le=64)
    ngram_max: int = Field(3, ge=1, le=64)
    # prompt_lookup+draft: prompt lookup proposes where its match is at least this many tokens
    # long (and ngram_min); a shorter match or none hands the step to the draft, whose guesses
    # cost draft steps but are right more often. 1: the draft only where nothing matched.
    fallback_ngram_min: int = Field(1, ge=1, le=64)
    # draft: a smaller model with the target's tokenizer (same vocabulary) proposes k tokens
    # greedily, run by this engine with its own paged KV cache (engine/spec/draft_proposer.py):
    # a local Hugging Face directory or a built-in name. Set, requests may ask for "draft" (and
    # "prompt_lookup+draft": prompt lookup's free guesses where it finds a match, the draft's
    # where it finds none) even when `method` is another.
    draft_model: str | None = Field(None, min_length=1)
    # The draft scores only the first N token ids (None: all). A BPE tokenizer numbers tokens in
    # merge order, frequent first (builtin:code-small's first 2048 ids are 85% of held-out code's
    # tokens), and the vocabulary projection is a quarter of a small draft's step; its guesses are
    # then always among those ids. Output stays exact either way (verification decides; a sampled
    # guess's distribution is the restricted one); only acceptance can change.
    draft_vocab_size: int | None = Field(None, ge=1)
    # "int8": the draft's decoder layers multiply by int8 copies of their weights in its decode
    # steps (one scale per output; each activation row quantized to 8 bits on the fly), on a CPU
    # with AVX512-VNNI and AVX512-BF16 and a bf16 draft (else the engine refuses to start). Half
    # the bytes a guess streams, so the draft's weights and the target's fit the caches together;
    # the guesses may differ from the bf16 draft's. Output stays exact either way (verification
    # decides); only acceptance and speed change. Prefill chunks keep the bf16 weights.
    draft_quantization: Literal["none", "int8"] = "none"
    # medusa: heads on the target's last hidden state, head i guessing the token i + 2 positions
    # past it (engine/spec/medusa_proposer.py): a directory in the published Medusa layout
    # (config.json + medusa_lm_head.safetensors / .pt, or a model.safetensors with `medusa_head.`
    # tensors) or `builtin:code-medusa` (heads for builtin:code-small). Set, requests may ask for
    # "medusa" even when `method` is another.
    medusa_heads: str | None = Field(None, min_length=1)
    # A step whose scheduled tokens (decodes, prefill chunks and proposals) reach this many is
    # no longer memory-bound: proposals past it would cost compute, so none are added. 0 = no
    # limit. Meant to keep speculation at saturation nearly free: benchmarks/spec_decode.py
    # measures it (docs/benchmarks.md: 0.99x on builtin:small, 0.92-0.94x on builtin:tiny).
    max_batch_tokens: int = Field(48, ge=0)
    # A step with more sequences than this (decodes and prompt chunks) gets no proposals and runs
    # no proposer: at saturation the step is compute-bound and speculation only costs (the rows,
    # and the per-sequence Python of proposing and verifying). 0 = no limit. The default is from
    # builtin:tiny on a CPU (docs/benchmarks.md): speculating paid at 4 sequences (1.06x) and
    # cost 7% at 8. Raise it where decode is memory-bound (larger models, GPUs).
    max_batch_seqs: int = Field(4, ge=0, le=4096)
    # Each request's k from its recent acceptance rate and what a proposed token costs: the k
    # with the most expected tokens per unit of step time, and growing pauses with one-token
    # probes where none pays (engine/spec/adaptive.py). Off: always num_tokens.
    adaptive: bool = True
    # Per method and step size, the tokens/s of steps that speculated with it is measured against
    # that of plain steps, and a method proposes only while it is at least as fast; the side not
    # chosen is re-measured now and then (engine/spec/cost_policy.py). Off: only the thresholds
    # above decide.
    cost_policy: bool = True

    @model_validator(mode="after")
    def _check_ngrams(self) -> SpeculativeConfig:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"speculative.ngram_min ({self.ngram_min}) is above ngram_max ({self.ngram_max})")
        if self.fallback_ngram_min > self.ngram_max:
            raise ValueError(f"speculative.fallback_ngram_min ({self.fallback_ngram_min}) is above ngram_max "
                             f"({self.ngram_max})")
        if self.method in ("draft", "prompt_lookup+draft") and self.draft_model is None:
            raise ValueError(f"speculative.method {self.method!r} needs speculative.draft_model: a local Hugging Face "
                             "directory (or builtin: name) with the target's tokenizer")
        if self.method == "medusa" and self.medusa_heads is None:
            raise ValueError("speculative.method 'medusa' needs speculative.medusa_heads: a directory of Medusa "
                             "heads for the target (config.json + medusa_lm_head.safetensors) or builtin:code-medusa")
        return self


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
    speculative: SpeculativeConfig = SpeculativeConfig()

    @property
    def world_size(self) -> int:
        """Processes one engine spans."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @model_validator(mode="after")
    def _check_budgets(self) -> EngineSettings:
        if self.speculative.draft_model is not None and self.world_size > 1:
            # The draft runs in the driver process only; its shards would need their own group.
            raise ValueError(f"speculative.draft_model runs on one process; tensor_parallel_size x "
                             f"pipeline_parallel_size is {self.world_size} (use prompt_lookup there)")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Otherwise the sequences at the tail of a full batch never get a decode token.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence needs a token each step"
            )
        return self


class EngineConfig(EngineSettings):
    model: str = Field("builtin:tiny", description="'builtin:tiny', 'builtin:small' or a local HF directory")
