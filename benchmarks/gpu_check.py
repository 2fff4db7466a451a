"""GPU figures for issue 12, measured side by side in one run on one GPU, printed as one table:

1. KV transfer: pages of a CUDA KV cache (`builtin:small` geometry, bf16) moved by KVSender over
   the ZMQ transport on loopback into a second CUDA cache by KVReceiver, in GB/s, next to the
   raw copies the path is made of: device -> pinned host, pinned host -> device, device -> device.
2. Decode step time of the engine on CUDA (Triton kernels, split-K where chosen) against the
   HBM floor: (weight bytes + KV bytes read per step) / measured copy bandwidth
   (engine/metrics/peak.py), for a small long-context batch and a wide one.

    python benchmarks/gpu_check.py            # what scripts/gpu_check.sh runs
    python benchmarks/gpu_check.py --quick    # fewer pages and steps

First run on an NVIDIA H200 on 2026-12-04 (docs/benchmarks.md, "The GPU check"); without CUDA it
says so and exits 0.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch


def cuda_seconds(fn, repeats: int = 5) -> float:
    """Best wall time of fn() with the device synchronised around it (after one warm-up)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def raw_copies(num_bytes: int) -> dict[str, float]:
    """GB/s of the copies a host-staged KV transfer is made of."""
    dev = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").fill_(1)
    dev2 = torch.empty_like(dev)
    pinned = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    return {
        "raw device -> pinned host": num_bytes / cuda_seconds(lambda: pinned.copy_(dev, non_blocking=True)) / 1e9,
        "raw pinned host -> device": num_bytes / cuda_seconds(lambda: dev2.copy_(pinned, non_blocking=True)) / 1e9,
        "raw device -> device": num_bytes / cuda_seconds(lambda: dev2.copy_(dev)) / 1e9,
    }


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def kv_transfer_gbps(num_pages: int, device: str = "cuda", pages_per_frame: int = 8) -> tuple[float, int]:
    """(GB/s, bytes) of one transfer of num_pages pages between two caches on `device` over ZMQ
    (`device` "cpu" only to smoke-test this script where there is no GPU)."""
    from engine.kv_cache import KVCache
    from engine.kv_transfer import KVReceiver, KVSender, TransferState, poll
    from engine.kv_transfer.zmq_transport import ZmqFrameReceiver, ZmqFrameSender
    from engine.model.builtin import ensure_builtin
    from engine.model.config import ModelConfig
    from proto.frame_auth import ClusterSecret

    cfg = ModelConfig.from_dir(ensure_builtin("small"))
    src = KVCache(cfg, num_pages, 16, torch.bfloat16, device)
    dst = KVCache(cfg, num_pages, 16, torch.bfloat16, device)
    for t in src.k + src.v:
        t.normal_()
    # As a cluster links a prefill and a decode worker with kv_transfer.checksum on: frames signed
    # under the cluster secret, headers only (the CRC32 covers the payload; cluster/worker_host.py).
    secret = ClusterSecret.generate()
    frames_in = ZmqFrameReceiver("127.0.0.1", 0, secret, sign_payload=False)
    sender = KVSender(ZmqFrameSender(frames_in.address, secret, sign_payload=False), checksum=True)
    receiver = KVReceiver(dst, require_checksum=True)
    pages = list(range(num_pages))
    outcomes = []

    def receive() -> None:
        deadline = time.monotonic() + 120
        while not outcomes and time.monotonic() < deadline:
            outcomes.extend(poll(receiver, frames_in, 0.01))

    receiver.expect("bench", pages, timeout_s=120)
    thread = threading.Thread(target=receive)
    thread.start()
    sync(device)
    start = time.perf_counter()
    sender.begin("bench", timeout_s=120)
    for i in range(0, num_pages, pages_per_frame):
        sender.send_cache_pages("bench", i, src, pages[i : i + pages_per_frame])
    assert sender.finish("bench") is TransferState.DONE
    thread.join()
    sync(device)
    seconds = time.perf_counter() - start
    assert outcomes and outcomes[0].state is TransferState.DONE, outcomes
    assert torch.equal(dst.read_pages(pages[:4]), src.read_pages(pages[:4]))
    total = math.prod(src.pages_shape(num_pages)) * 2  # bf16
    return total / seconds / 1e9, total


def decode_step_ms(num_seqs: int, context_len: int, steps: int, device: str = "cuda",
                   model: str = "builtin:small") -> tuple[float, float, float]:
    """(p50 step ms, HBM floor ms, measured bandwidth GB/s) for num_seqs decodes at context_len
    (`device` "cpu" only to smoke-test this script where there is no GPU)."""
    from configs import EngineConfig
    from engine import LLMEngine, SamplingParams
    from engine.metrics.peak import measure_peak

    engine = LLMEngine(EngineConfig(model=model, device=device, dtype="bfloat16", page_size=16,
                                    kv_cache_memory_bytes=4 << 30, max_num_seqs=max(num_seqs, 1),
                                    max_num_batched_tokens=8192, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"d{i}", [1] + [(i * 7 + j) % 4000 + 2 for j in range(context_len - 1)], params)
    started: set[str] = set()
    while len(started) < num_seqs:  # every prompt prefilled: only decodes from here on
        started.update(out.request_id for out in engine.step() if out.new_token_ids)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()  # returns sampled tokens on the host: the step has finished on the device
        times.append(time.perf_counter() - start)
    cfg = engine.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    kv_bytes = num_seqs * context_len * cfg.kv_bytes_per_token(2)  # every cached K/V read once
    peak = measure_peak(device, torch.bfloat16, copy_bytes=(1 << 30) if device.startswith("cuda") else 64 << 20)
    floor_ms = (weight_bytes + kv_bytes) / peak.memory_bytes_per_s * 1e3
    engine.close()
    return statistics.median(times) * 1e3, floor_ms, peak.memory_bytes_per_s / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer pages and steps")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check benchmark: no CUDA device on this machine; nothing measured")
        return 0
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M %Z')}")
    rows: list[tuple[str, str]] = []
    num_pages = 256 if args.quick else 1024
    gbps, num_bytes = kv_transfer_gbps(num_pages)
    rows.append((f"KV transfer, ZMQ via host, {num_bytes / 2**20:.0f} MiB", f"{gbps:.2f} GB/s"))
    rows += [(name, f"{value:.2f} GB/s") for name, value in raw_copies(num_bytes).items()]
    steps = 20 if args.quick else 50
    for num_seqs, context_len in ((1, 4000), (4, 2048), (64, 1024)):
        step_ms, floor_ms, bandwidth = decode_step_ms(num_seqs, context_len, steps)
        rows.append((f"decode step, {num_seqs} x {context_len} tokens (p50)",
                     f"{step_ms:.2f} ms = {step_ms / floor_ms:.1f}x the HBM floor {floor_ms:.3f} ms "
                     f"({bandwidth:.0f} GB/s measured)"))
    width = max(len(name) for name, _ in rows)
    print(f"{'measure':<{width}}  value")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
