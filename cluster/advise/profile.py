"""The short profiling run of `pdserve advise`: the step costs (costs.py) of the real engine on
this machine, at each thread count a worker of the compared layouts gets, and the KV link's
latency and bandwidth over loopback ZMQ.

Per thread count: one engine (the model, its dtype, chunked prefill at `budget` tokens) times
  - prefill-only steps of a `budget // 4`- and a `budget`-token prompt (best of two each), and
  - decode-only steps of 1 and 16 running sequences (median of five each);
the decode points give the fixed cost and the cost per sequence, the two prefill points (over
that fixed cost) the linear and square terms per prompt token, so both chunks' times are exact.
About 10 s a thread count on builtin:small at a 2048-token budget.
"""

from __future__ import annotations

import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Iterable

import torch
import zmq

from cluster.advise.costs import Costs, LinkCost, StepCost
from configs import EngineConfig
from engine import LLMEngine, SamplingParams

DECODE_BATCHES = (1, 16)
LINK_FRAME_BYTES = 1 << 20
LINK_FRAMES = 48


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _prompt(n: int, salt: int) -> list[int]:
    return [(salt * 7919 + i * 31) % 1000 + 3 for i in range(n)]  # distinct prompts: no prefix-cache hits


def _timed_step(engine: LLMEngine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def step_cost(model: str, threads: int, budget: int, dtype: str = "auto") -> StepCost:
    """The fitted step cost of one engine on `threads` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    engine = LLMEngine(EngineConfig.model_validate({"model": model, "dtype": dtype, "max_num_batched_tokens": budget,
                                                      "max_num_seqs": 64}))
    salt = iter(range(1, 1 << 30))
    try:
        def prefill_s(n: int) -> float:
            best = float("inf")
            for _ in range(2):
                rid = f"p{next(salt)}"
                engine.add_request(rid, _prompt(n, int(rid[1:])), SamplingParams(max_tokens=1, ignore_eos=True))
                best = min(best, _timed_step(engine))
                while engine.has_unfinished_requests():
                    engine.step()
            return best

        def decode_s(batch: int) -> float:
            ids = [f"d{next(salt)}" for _ in range(batch)]
            for rid in ids:
                engine.add_request(rid, _prompt(16, int(rid[1:])), SamplingParams(max_tokens=12, ignore_eos=True))
            engine.step()  # their prompts, in one step
            times = [_timed_step(engine) for _ in range(5)]
            for rid in ids:
                engine.abort_request(rid)
            return statistics.median(times)

        prefill_s(64)  # warm-up: first-call costs stay out
        decode_s(2)
        p_small, p_full = prefill_s(budget // 4), prefill_s(budget)
        d1, d2 = (decode_s(b) for b in DECODE_BATCHES)
        per_seq = max(0.0, (d2 - d1) / (DECODE_BATCHES[1] - DECODE_BATCHES[0]))
        fixed = max(0.0, d1 - per_seq * DECODE_BATCHES[0])
        # (t - fixed) / p = a + c p at both points: a line through the two per-token costs.
        small = budget // 4
        per_small, per_full = (p_small - fixed) / small, (p_full - fixed) / budget
        square = max(0.0, (per_full - per_small) / (budget - small))
        linear = max(per_full - square * budget, 1e-9)
        return StepCost(fixed, linear, per_seq, square)
    finally:
        engine.close()
        torch.set_num_threads(before)


def kv_bytes_per_token(model: str, dtype: str = "auto") -> int:
    engine = LLMEngine(EngineConfig.model_validate({"model": model, "dtype": dtype, "max_num_seqs": 1,
                                                      "kv_cache_memory_bytes": 1 << 24}))
    try:
        cache = engine.kv_cache
        page = engine.config.page_size
        count = 1
        for d in cache.pages_shape(1):
            count *= d
        return count * cache.dtype.itemsize // page
    finally:
        engine.close()


def link_cost() -> LinkCost:
    """Loopback ZMQ PUSH -> PULL: one small frame's one-way latency (median of 20) and the
    bandwidth of LINK_FRAMES frames of 1 MiB (what a KV transfer's frames are like)."""
    ctx: zmq.Context = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        latencies = []
        for _ in range(20):
            start = time.perf_counter()
            push.send(b"x")
            pull.recv()
            latencies.append(time.perf_counter() - start)
        payload = os.urandom(LINK_FRAME_BYTES)
        got: list[object] = []
        reader = threading.Thread(target=lambda: got.extend(pull.recv(copy=False) for _ in range(LINK_FRAMES)))
        start = time.perf_counter()
        reader.start()
        for _ in range(LINK_FRAMES):
            push.send(payload, copy=False)
        reader.join(30)
        elapsed = time.perf_counter() - start
        return LinkCost(statistics.median(latencies), LINK_FRAMES * LINK_FRAME_BYTES / elapsed)
    finally:
        push.close(0)
        pull.close(0)


def profile(model: str, thread_counts: Iterable[int], budget: int = 2048, dtype: str = "auto",
            say: Callable[[str], None] = print) -> Costs:
    by_threads = {}
    for threads in sorted(set(thread_counts)):
        start = time.perf_counter()
        by_threads[threads] = cost = step_cost(model, threads, budget, dtype)
        say(f"  {threads} thread{'s' if threads > 1 else ''}: step = {cost.fixed_s * 1e3:.1f} ms + "
            f"{cost.per_prompt_token_s * 1e6:.0f} us/prompt token (+ {cost.per_prompt_token2_s * 1e9:.0f} ns x tokens) + "
            f"{cost.per_sequence_s * 1e3:.2f} ms/sequence "
            f"({time.perf_counter() - start:.1f} s)")
    link = link_cost()
    kv = kv_bytes_per_token(model, dtype)
    say(f"  KV: {kv} bytes/token; link: {link.latency_s * 1e6:.0f} us + {link.bytes_per_s / 1e9:.2f} GB/s")
    return Costs(model, by_threads, kv, link, cpu_name())
