"""One request's state inside an engine: its tokens, progress, pages and outcome.

Created by LLMEngine.add_request, moved between the scheduler's waiting and running queues,
advanced by the engine after each step. `num_computed_tokens` counts tokens whose KV is in the
cache; the tokens after it are what the next step must compute (a prompt chunk or the one
newly sampled token).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams
from engine.spec.adaptive import SpecState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos or a stop token
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_index: int  # admission order; the scheduler preempts the latest first
    max_total_tokens: int  # prompt + output may not exceed this (model context length)
    token_ids: list[int] = field(init=False)  # prompt followed by generated tokens
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    page_table: list[int] = field(default_factory=list)
    page_hashes: list[bytes] = field(default_factory=list)  # hashes of the leading full pages
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at the latest admission
    num_preemptions: int = 0
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None
    hold_kv: bool = False  # on finish, keep the pages for a KV transfer (prefill role)
    arrival_time: float = field(default_factory=time.monotonic)  # for the queue-time metric
    first_scheduled_time: float | None = None
    spec: SpecState | None = None  # speculative decoding: k, pauses and totals (engine/spec/)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens_left(self) -> int:
        """Tokens it may still generate: within max_tokens and its context (EOS and stops aside)."""
        return min(self.params.max_tokens - (self.num_tokens - self.num_prompt_tokens),
                   self.max_total_tokens - self.num_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
