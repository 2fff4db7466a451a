"""What crosses the engine's API per request: prompt token ids in (checked), RequestOutput out.

`LLMEngine.add_request` takes a prompt through `token_id_list`; `LLMEngine.step` returns one
`RequestOutput` per request that computed or emitted something in the step (several tokens at
once when speculative decoding accepted a run).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

from engine.sequence import FinishReason


@dataclass
class RequestOutput:
    """What one step produced for one request: the tokens added since the last output."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)  # all generated so far
    logprobs: list[float] = field(default_factory=list)  # all so far, when params.logprobs
    num_spec_proposed: int = 0  # speculative tokens proposed for this request so far
    num_spec_accepted: int = 0  # of which the target kept


def token_id_list(tokens: object) -> list[int]:
    """Prompt token ids as a list of Python ints (lists, tuples, numpy or torch 1-D arrays);
    ValueError for anything that is not a sequence of integers."""
    if hasattr(tokens, "tolist"):  # numpy / torch arrays
        tokens = tokens.tolist()
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__iter__"):
        raise ValueError(f"prompt token ids must be a list of integers, got {type(tokens).__name__}")
    ids = list(tokens)
    wrong = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
    if wrong:
        raise ValueError(f"prompt token ids must be integers, got {wrong[:5]}")
    return [int(t) for t in ids]
