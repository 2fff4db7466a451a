"""Offline, in-process API in the style users know from vLLM.

    from engine import LLM, SamplingParams
    llm = LLM("builtin:tiny")
    outs = llm.generate(["def add(a, b):", [0, 17, 42]], SamplingParams(max_tokens=32))
    outs[0].token_ids, outs[0].text

A thin loop over LLMEngine: queue every prompt, step until all finish, collect per prompt.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from configs.engine import EngineConfig
from engine.engine import LLMEngine
from engine.parallel.shard_follower import start_local_group
from engine.request_io import RequestOutput, token_id_list
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids, prompt excluded
    text: str
    finish_reason: str
    logprobs: list[float] | None
    num_cached_prompt_tokens: int


class LLM:
    def __init__(self, model: str = "builtin:tiny", **engine_kwargs) -> None:
        """With tensor_parallel_size / pipeline_parallel_size > 1 the other ranks run as local
        subprocesses; call `close()` (or use `with LLM(...) as llm`) to end them."""
        config = EngineConfig(model=model, **engine_kwargs)
        self._local_group = start_local_group(config) if config.world_size > 1 else None
        try:
            self.engine = LLMEngine(config, self._local_group.group if self._local_group else None)
        except BaseException:
            self._stop_group()
            raise
        self._next_id = 0

    def close(self) -> None:
        self.engine.close()
        self._stop_group()

    def _stop_group(self) -> None:
        if self._local_group is not None:
            self._local_group.stop()
            self._local_group = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[CompletionOutput]:
        """One output per prompt, in prompt order. Strings are tokenized with the model's
        tokenizer (adding its BOS as Hugging Face does); lists are taken as token ids."""
        if hasattr(prompts, "tolist"):  # a numpy / torch array of token ids
            prompts = prompts.tolist()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]  # a single prompt
        params_list = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} SamplingParams")
        token_prompts = [self.engine.encode(p) if isinstance(p, str) else token_id_list(p) for p in prompts]
        ids = []
        try:
            for tokens, p in zip(token_prompts, params_list):
                request_id = f"llm-{self._next_id}"
                self._next_id += 1
                self.engine.add_request(request_id, tokens, p)
                ids.append(request_id)
        except Exception:
            for request_id in ids:  # a bad prompt leaves nothing of this call queued
                self.engine.abort_request(request_id)
            raise
        results: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
                while len(results) < len(ids):
                    for out in self.engine.step():
                        if out.finished:
                            results[out.request_id] = out
                            bar.update()
        finally:  # on an error (or Ctrl-C) nothing of this call stays queued
            for request_id in ids:
                if request_id not in results:
                    self.engine.abort_request(request_id)
        collected = []
        for request_id, tokens, p in zip(ids, token_prompts, params_list):
            out = results[request_id]
            collected.append(CompletionOutput(
                prompt_token_ids=tokens,
                token_ids=list(out.token_ids),
                text=self.engine.decode(out.token_ids),
                finish_reason=out.finish_reason.value,
                logprobs=list(out.logprobs) if p.logprobs else None,
                num_cached_prompt_tokens=out.num_cached_prompt_tokens,
            ))
        return collected
