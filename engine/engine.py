"""The step-driven engine: requests in, one model step per `step()`, incremental outputs out.

This is what the workers drive (and what engine/llm.py wraps for offline use):
    engine.add_request(request_id, prompt_token_ids, params)   # validates, queues
    while engine.has_unfinished_requests():
        for out in engine.step():                              # schedule -> run -> sample
            ...                                                # new tokens, finish reason
    engine.abort_request(request_id)                           # frees its pages at once
Each step: the scheduler picks sequences and token counts, the speculator adds proposed tokens
to decodes (speculative decoding, engine/spec/; off unless configured or asked), the model
runner executes them as one ForwardBatch, the sampler picks a token for each sequence whose
known tokens are now all computed (verifying proposals: 1..k+1 tokens), and finished sequences
release their pages exactly once.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from configs.engine import EngineConfig
from engine.kv_cache import KVCache
from engine.kv_transfer.handoff import KVHandoff
from engine.metrics.step_stats import StepStats, StepWork
from engine.model.loader import load_tokenizer, resolve_model_path
from engine.model_runner import ModelRunner
from engine.page_manager import PageManager
from engine.parallel.layout import ShardGroup, ShardLayout
from engine.parallel.model_shard import load_shard
from engine.parallel.shard_executor import GroupDriver, LocalExecutor
from engine.parallel.sharded_kv_cache import ShardedKVCache
from engine.request_io import RequestOutput, token_id_list
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import FinishReason, Sequence
from engine.snapshot import EngineSnapshot
from engine.spec import BaseProposer, Speculator
from engine.spec.draft_model import load_draft_model
from engine.spec.draft_proposer import DraftModelProposer
from engine.spec.fallback_proposer import FallbackProposer
from engine.spec.guess_cost import medusa_guess_cost
from engine.spec.medusa_proposer import MedusaProposer, load_configured_heads
from engine.spec.prompt_lookup import PromptLookupProposer
from engine.spec.speculator import build_proposers


class LLMEngine:
    def __init__(self, config: EngineConfig, group: ShardGroup | None = None) -> None:
        """`group`: this process is rank 0 (the driver) of a tensor/pipeline-parallel worker
        whose other ranks run engine.parallel.shard_follower; None = the whole model here."""
        self.config = config
        self.model_path = resolve_model_path(config.model, config.cache_dir)
        backend_name = config.attention_backend
        if backend_name == "triton" and not config.device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
            # The interpreter can run the kernels on CPU, but only tests should choose that.
            raise ValueError("attention_backend 'triton' needs device 'cuda' (or TRITON_INTERPRET=1 for tests)")
        if config.world_size > 1 and group is None:
            raise ValueError(
                f"tensor_parallel_size x pipeline_parallel_size = {config.world_size} needs a shard group: "
                "start the worker with `pdserve up` or engine.parallel.shard_follower.start_local_group")
        layout = group.layout if group is not None else ShardLayout(1, 1, 0)
        shard = load_shard(config, self.model_path, layout, group)
        self.model, num_pages = shard.model, shard.num_pages
        self.model_config = self.model.cfg
        self.tokenizer = load_tokenizer(self.model_path)
        model_len = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_len:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context of {model_len} tokens")
        self.max_model_len = config.max_model_len or model_len
        if group is None:
            self.executor: LocalExecutor | GroupDriver = LocalExecutor(self.model, shard.kv_cache)
            self.kv_cache: KVCache | ShardedKVCache = shard.kv_cache
        else:
            self.executor = GroupDriver(group, self.model, shard.kv_cache)
            self.kv_cache = ShardedKVCache(self.model_config, self.executor)
        self.page_manager = PageManager(num_pages, config.page_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.page_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.executor, config.page_size, config.device)
        self.speculator = Speculator(config.speculative, self._proposers(num_pages))
        self.handoff = KVHandoff(self.page_manager)  # KV crossing engines (disaggregation)
        self._seqs: dict[str, Sequence] = {}
        self._num_arrivals = 0
        self.num_steps = 0
        self._step_observers: list[Callable[[StepStats], None]] = []
        self.snapshot = EngineSnapshot()
        self.publish_snapshot()

    def _proposers(self, num_pages: int) -> dict[str, BaseProposer]:
        """Every speculative method this engine serves: prompt lookup always, a draft model when
        one is configured (loaded here, beside the target, with as many KV pages; and then
        prompt_lookup+draft, the draft where prompt lookup finds nothing), Medusa heads
        when configured (on the target's hidden states: no pages)."""
        spec = self.config.speculative
        proposers = build_proposers(spec)
        if spec.draft_model is not None:
            draft = load_draft_model(self.config, self.model_config, num_pages)
            draft_proposer = DraftModelProposer(draft, self.config.max_num_batched_tokens)
            proposers[draft_proposer.method] = draft_proposer
            # The draft instance is shared: one draft model and one set of draft pages serve both methods.
            lookup = PromptLookupProposer(max(spec.ngram_min, spec.fallback_ngram_min), spec.ngram_max)
            hybrid = FallbackProposer(lookup, draft_proposer, spec.adaptive)
            proposers[hybrid.method] = hybrid
        if self.config.speculative.medusa_heads is not None:
            heads = load_configured_heads(self.config, self.model)
            proposers[MedusaProposer.method] = MedusaProposer(heads, medusa_guess_cost(heads.cfg, self.model_config))
        return proposers

    def add_step_observer(self, observer: Callable[[StepStats], None]) -> None:
        """`observer(stats)` runs after every step that computed something (live metrics)."""
        self._step_observers.append(observer)

    # -- requests ---------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, hold_kv: bool = False
    ) -> None:
        """Validates and queues a request; raises ValueError (and queues nothing) on bad input.
        With `hold_kv`, the request's pages outlive it for a KV transfer (see `held_kv`)."""
        if request_id in self.handoff:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        seq.hold_kv = hold_kv
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def _new_sequence(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Sequence:
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = token_id_list(prompt_token_ids)
        if not ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt has token ids outside [0, {vocab}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the model's context is {self.max_model_len} tokens "
                f"and at least one must be left to generate"
            )
        capacity = self.page_manager.num_pages * self.page_manager.page_size
        # The last sampled token is returned, never fed back: its KV is not needed.
        needed = min(len(ids) + params.max_tokens - 1, self.max_model_len)
        if needed > capacity:
            raise ValueError(
                f"request needs up to {needed} tokens of KV cache (prompt {len(ids)} + max_tokens "
                f"{params.max_tokens}) but the whole cache holds {capacity}"
            )
        seq = Sequence(request_id, ids, params, self._num_arrivals, self.max_model_len)
        self._num_arrivals += 1
        return seq

    def add_prefilled_request(
        self, request_id: str, prompt_token_ids: list[int], first_token: int, params: SamplingParams
    ) -> RequestOutput | None:
        """Joins a request whose prompt KV was written into its reservation (and whose first
        token was sampled by the prefill side) to the decode batch. Returns its output at once
        if the first token already ends it (EOS, stop token, max_tokens=1)."""
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        res = self.handoff.reservation(request_id)
        if res.num_tokens != seq.num_prompt_tokens:
            raise ValueError(f"reservation covers {res.num_tokens} tokens, the prompt has {seq.num_prompt_tokens}")
        self.handoff.take(request_id)
        self.speculator.joined(request_id)
        seq.page_table, seq.page_hashes = list(res.page_ids), list(res.page_hashes)
        seq.num_computed_tokens = seq.num_cached_prompt_tokens = seq.num_prompt_tokens
        seq.token_ids.append(int(first_token))
        self._seqs[request_id] = seq
        self.scheduler.add_running(seq)
        reason = self._stop_reason(seq, int(first_token))
        if reason is None:
            return None
        self._finish(seq, reason)
        return RequestOutput(request_id, [], [], True, reason, seq.num_prompt_tokens,
                             seq.num_cached_prompt_tokens, seq.output_token_ids, [])

    def expect_prefilled_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """A request whose pages were reserved (handoff.reserve) and whose KV is on its way: a
        proposer that keeps KV of its own (a draft model) computes the prompt's in `run_ahead`,
        while the prefill worker computes the target's, and not in the request's first decode
        step. Raises ValueError where add_prefilled_request would."""
        self.speculator.expect(self._new_sequence(request_id, prompt_token_ids, params))

    def run_ahead(self) -> bool:
        """Some of the expected requests' work (at most a step's token budget of a draft's
        prompt KV), outside any step, and only while no request runs here: it fills the wait for
        the KV and never delays a step (under load the draft's prompt would cost the batch's
        steps and go unused where the batch has grown past speculating by the join; then the
        request's first speculating step computes it, if it ever speculates). Returns whether
        there was any."""
        if self.scheduler.has_unfinished():
            return False
        return self.speculator.prefill_ahead(1, self.scheduler.max_num_batched_tokens)

    def abort_request(self, request_id: str) -> bool:
        """Ends a request now and frees its pages (also held KV and reservations); False if
        it holds nothing here."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.speculator.release(seq)
            self.scheduler.finish(seq, FinishReason.ABORT)
            return True
        self.speculator.forget(request_id)
        return self.handoff.drop(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step loop ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        self.speculator.begin_step()
        sched = self.scheduler.schedule()
        for seq in sched.preempted:
            self.speculator.release(seq)
        if not sched.scheduled:
            return []
        self.speculator.plan(sched, self.scheduler)
        if not self._step_observers:
            outputs = self._run(sched)
            self.speculator.end_step()
            self.publish_snapshot()
            return outputs
        work = StepWork.of(sched.scheduled)  # before the step advances progress
        now = time.monotonic()
        queue_times = []
        for s in sched.scheduled:
            if s.seq.first_scheduled_time is None:
                s.seq.first_scheduled_time = now
                queue_times.append(now - s.seq.arrival_time)
        outputs = self._run(sched)
        self.speculator.end_step()
        pm = self.page_manager
        stats = StepStats(work, time.perf_counter() - start, tuple(queue_times), pm.num_referenced_pages,
                          pm.num_free_pages, self.speculator.step_stats)
        self.publish_snapshot()
        for observer in self._step_observers:
            observer(stats)
        return outputs

    def _run(self, sched: SchedulerOutput) -> list[RequestOutput]:
        hidden, sampled = self.runner.execute_hidden(sched.scheduled)
        self.scheduler.finish_step(sched)
        self.num_steps += 1
        if not sampled:
            return []
        outputs = []
        # The hidden rows go to proposers that read them (Medusa heads) before the tokens are appended.
        for s, result in zip(sampled, self.speculator.sample(self.runner.logits(hidden), sampled, hidden)):
            seq = s.seq
            new_tokens, new_logprobs, reason = [], [], None
            # Tokens one at a time: a stop token or max_tokens inside an accepted run ends it there.
            for token, logprob in zip(result.token_ids, result.logprobs):
                seq.token_ids.append(token)
                new_tokens.append(token)
                if seq.params.logprobs:
                    seq.logprobs.append(logprob)
                    new_logprobs.append(logprob)
                if (reason := self._stop_reason(seq, token)) is not None:
                    break
            if reason is not None:
                self._finish(seq, reason)
            elif s.draft is not None:
                self.scheduler.commit_drafts(seq, result.num_accepted)
            spec = seq.spec
            outputs.append(RequestOutput(
                request_id=seq.request_id,
                new_token_ids=new_tokens,
                new_logprobs=new_logprobs,
                finished=reason is not None,
                finish_reason=reason,
                num_prompt_tokens=seq.num_prompt_tokens,
                num_cached_prompt_tokens=seq.num_cached_prompt_tokens,
                token_ids=seq.output_token_ids,
                logprobs=list(seq.logprobs),
                num_spec_proposed=spec.num_proposed if spec else 0,
                num_spec_accepted=spec.num_accepted if spec else 0,
            ))
        return outputs

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.speculator.release(seq)
        kept = self.scheduler.finish(seq, reason, keep_pages=seq.hold_kv)
        if seq.hold_kv:
            self.handoff.hold(seq.request_id, kept, seq.num_computed_tokens)
        del self._seqs[seq.request_id]

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.model_config.eos_token_ids):
            return FinishReason.STOP
        if len(seq.token_ids) - seq.num_prompt_tokens >= p.max_tokens or seq.num_tokens >= seq.max_total_tokens:
            return FinishReason.LENGTH
        return None

    def computed_kv(self, request_id: str) -> tuple[list[int], int]:
        """Pages of a running or held request and how many of its tokens have KV in them, so
        a prefill worker can ship pages as chunks complete instead of after the whole prompt."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            return list(seq.page_table), seq.num_computed_tokens
        held = self.handoff.held(request_id)
        return list(held.page_ids), held.num_tokens

    # -- introspection (tests, metrics) -------------------------------------------------------
    def page_stats(self) -> dict[str, int]:
        """KV page counts now; on the engine's own thread only (other threads read `snapshot`)."""
        return EngineSnapshot.of(self.scheduler, self.page_manager, self.num_steps).page_stats()

    def publish_snapshot(self) -> EngineSnapshot:
        """Replaces `snapshot` with the state now. Called on the engine's own thread: by `step`, and
        by the serving loop after each turn (reservations and admissions change pages between steps)."""
        self.snapshot = EngineSnapshot.of(self.scheduler, self.page_manager, self.num_steps,
                                          frozenset(self._seqs.keys() | self.handoff.request_ids()))
        return self.snapshot

    def encode(self, text: str) -> list[int]:
        """Tokenizes a text prompt the way Hugging Face does (BOS added where the model adds it)."""
        if not isinstance(text, str):
            raise TypeError(f"prompt text must be a str, got {type(text).__name__}")
        if not text:
            raise ValueError("prompt is empty: it must contain at least one character")
        return self.tokenizer(text)["input_ids"]

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def close(self) -> None:
        """Releases the follower ranks of a TP x PP worker (no-op for a single process)."""
        self.executor.close()

    @torch.inference_mode()
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())
