"""The inference engine shared by prefill and decode workers: model, paged KV cache, page
manager with prefix cache, scheduler, sampler, and the step-driven LLMEngine.

`from engine import LLM, SamplingParams` is the offline API.
"""

from engine.engine import LLMEngine
from engine.llm import LLM, CompletionOutput
from engine.request_io import RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "CompletionOutput", "SamplingParams"]
