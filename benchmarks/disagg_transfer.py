"""Disaggregation costs, measured side by side in one run on one model:

1. KV-transfer throughput of the ZMQ transport (KVSender -> KVReceiver writing into a real KV
   cache) versus raw loopback TCP bandwidth (plain sockets, same byte count). Target >= 70%.
2. KV-transfer time as a share of TTFT for 512- and 2048-token prompts: prefill time on the
   engine vs the time to move that prompt's pages. Target <= 5%. (The first token does not
   wait for the transfer in pdserve; this says how much decode start-up the transfer adds.)
3. Router overhead per streamed token: inter-token latency through gRPC (a `pdserve up`
   cluster: router and colocated worker in their own processes, ZMQ between them) minus the
   engine's own step time in-process, p50/p99.

    python benchmarks/disagg_transfer.py                  # builtin:small
    python benchmarks/disagg_transfer.py --model builtin:tiny --repeats 2   # quick look
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

from configs import EngineConfig
from engine import LLMEngine, SamplingParams
from engine.kv_transfer import KVReceiver, KVSender, TransferState, poll
from engine.kv_transfer.zmq_transport import ZmqFrameReceiver, ZmqFrameSender
from loadgen.metrics import percentile
from proto import pdserve_pb2 as pb
from proto.frame_auth import ClusterSecret


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raw_loopback_seconds(num_bytes: int, chunk: int = 1 << 20) -> float:
    """Plain TCP over 127.0.0.1 on an open connection: seconds to move num_bytes."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    payload = bytes(chunk)
    buf = bytearray(chunk)

    def send() -> None:
        sent = 0
        while sent < num_bytes:
            n = min(chunk, num_bytes - sent)
            client.sendall(payload[:n])
            sent += n

    t = threading.Thread(target=send)
    start = time.perf_counter()
    t.start()
    received = 0
    while received < num_bytes:
        received += conn.recv_into(buf)
    elapsed = time.perf_counter() - start
    t.join()
    for s in (client, conn, server):
        s.close()
    return elapsed


def _receiver_process(model_dir: str, dtype: str, num_pages: int, page_size: int, secret: str, conn) -> None:
    """The decode side in its own process (as in a cluster): a KV cache, a ZMQ receiver, and a
    loop that reports the time each expected transfer completed."""
    from engine.kv_cache import KVCache
    from engine.model.config import ModelConfig
    from engine.model.loader import DTYPES

    cache = KVCache(ModelConfig.from_dir(model_dir), num_pages, page_size, DTYPES[dtype], "cpu")
    frames = ZmqFrameReceiver("127.0.0.1", 0, ClusterSecret(secret), sign_payload=False)  # as a cluster signs: headers
    receiver = KVReceiver(cache)
    conn.send(frames.address)
    while True:
        request = conn.recv()
        if request is None:
            break
        rid, dest = request
        receiver.expect(rid, dest, timeout_s=120)
        conn.send("ready")
        outcome: list = []
        while not outcome:
            outcome = poll(receiver, frames, 0.001)
        conn.send((time.perf_counter(), outcome[0].state.value))
    frames.close()


class ZmqLink:
    """One open KV link to a receiver process (as between a prefill and a decode worker)."""

    def __init__(self, model_dir: Path, dtype: str, num_pages: int, page_size: int) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        secret = ClusterSecret.generate()
        self.proc = ctx.Process(target=_receiver_process,
                                args=(str(model_dir), dtype, num_pages, page_size, secret.reveal(), child))
        self.proc.start()
        self.sender = KVSender(ZmqFrameSender(self.conn.recv(), secret, sign_payload=False))
        self.count = 0

    def transfer_seconds(self, src: LLMEngine, pages: list[int], pages_per_frame: int = 8) -> float:
        """Moves `pages` of src's cache into the receiver's cache; seconds from first send to DONE."""
        self.count += 1
        rid = f"t{self.count}"
        self.conn.send((rid, list(range(len(pages)))))
        assert self.conn.recv() == "ready"
        start = time.perf_counter()
        self.sender.begin(rid, timeout_s=120)
        for i in range(0, len(pages), pages_per_frame):
            self.sender.send_cache_pages(rid, i, src.kv_cache, pages[i : i + pages_per_frame])
        state = self.sender.finish(rid)
        done_at, outcome = self.conn.recv()
        assert state is TransferState.DONE and outcome == "done", (state, outcome)
        return done_at - start

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(30)
        self.sender.transport.close()


def prefill_seconds(engine: LLMEngine, num_tokens: int, salt: int) -> tuple[float, list[int]]:
    """Prefill time of one prompt (one or more chunked steps up to its first token); its pages held."""
    prompt = [0] + [(salt * 7919 + i * 104729) % (engine.model_config.vocab_size - 3) + 3 for i in range(num_tokens - 1)]
    engine.add_request(f"p{salt}", prompt, SamplingParams(max_tokens=1, ignore_eos=True), hold_kv=True)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start, list(engine.handoff.held(f"p{salt}").page_ids)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    cfg = EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory_bytes=2 << 30, max_num_batched_tokens=2048,
                       enable_prefix_caching=False)
    src, dst = LLMEngine(cfg), LLMEngine(cfg)
    page_bytes = src.model_config.kv_bytes_per_token(torch.finfo(src.kv_cache.k[0].dtype).bits // 8) * cfg.page_size
    print(f"model {args.model} ({args.dtype}), KV {page_bytes / cfg.page_size / 1024:.0f} KiB per token")

    # 1 + 2: prefill and transfer of 512- and 2048-token prompts.
    print("\n[KV transfer vs raw loopback, and vs prefill time]")
    link = ZmqLink(src.model_path, args.dtype, 256, cfg.page_size)
    prefill_seconds(src, 64, 0)  # warm-up: first-call costs are not what is measured
    link.transfer_seconds(src, list(src.handoff.held("p0").page_ids))
    src.handoff.release("p0")
    for n, salt in ((512, 1), (min(2048, src.max_model_len - 1), 2)):
        prefill_s, pages = prefill_seconds(src, n, salt)
        nbytes = len(pages) * page_bytes
        transfers = [link.transfer_seconds(src, pages) for _ in range(args.repeats)]
        raws = [raw_loopback_seconds(nbytes) for _ in range(args.repeats)]
        t, raw = statistics.median(transfers), statistics.median(raws)
        print(f"  {n:5d}-token prompt: {nbytes / 2**20:6.1f} MiB in {len(pages)} pages | prefill {1000 * prefill_s:7.1f} ms"
              f" | transfer p50 {1000 * t:6.1f} ms ({nbytes / t / 2**30:.2f} GiB/s) | raw TCP p50 {1000 * raw:6.1f} ms"
              f" ({nbytes / raw / 2**30:.2f} GiB/s)")
        print(f"        transfer / raw bandwidth = {raw / t:.0%} (target >= 70%)   "
              f"transfer / TTFT = {t / prefill_s:.1%} (target <= 5%)")
        src.handoff.release(f"p{salt}")
    link.close()

    # 3: router overhead per streamed token, colocated through gRPC vs the engine in-process.
    print("\n[router overhead per streamed token]")
    prompt = list(range(3, 131))
    tokens = 128
    # One compute thread on both sides, each in a fresh process: on a 2-core machine the router
    # and the client need the other core, and an OpenMP team that loses a core stalls.
    del src, dst
    engine_itl = engine_stream_in_subprocess(args.model, cfg, prompt, tokens)
    grpc_itl = stream_through_cluster(args.model, cfg, prompt, tokens)
    for p in (50, 99):
        e, g = percentile(engine_itl, p), percentile(grpc_itl, p)
        print(f"  p{p}: engine in-process {1000 * e:6.2f} ms/token, through gRPC {1000 * g:6.2f} ms/token, "
              f"overhead {1000 * (g - e):+6.2f} ms ({(g - e) / e:+.1%})")
    return 0


def engine_stream_in_subprocess(model: str, cfg: EngineConfig, prompt: list[int], tokens: int) -> list[float]:
    """Inter-token latencies of the engine alone, in its own 1-thread process (like the actor)."""
    import json
    import subprocess

    code = (
        "import json,sys,time,torch; torch.set_num_threads(1)\n"
        "from configs import EngineConfig; from engine import LLMEngine, SamplingParams\n"
        "a=json.loads(sys.argv[1]); e=LLMEngine(EngineConfig(**a['cfg']))\n"
        "e.add_request('s', a['prompt'], SamplingParams(max_tokens=a['tokens'], ignore_eos=True))\n"
        "itl=[]; last=None\n"
        "while e.has_unfinished_requests():\n"
        "    if e.step():\n"
        "        now=time.perf_counter(); itl += [now-last] if last else []; last=now\n"
        "print(json.dumps(itl))\n")
    arg = json.dumps({"cfg": cfg.model_dump(), "prompt": prompt, "tokens": tokens})
    out = subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1], env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def stream_through_cluster(model: str, cfg: EngineConfig, prompt: list[int], tokens: int) -> list[float]:
    """Inter-token latencies of one stream through a real cluster: `pdserve up`'s Ray actors,
    so the router and the worker are separate processes, as deployed."""
    import grpc

    from cluster import launcher
    from configs import ClusterConfig
    from proto import pdserve_pb2_grpc

    engine = {k: v for k, v in cfg.model_dump().items() if k != "model"}
    cluster_cfg = ClusterConfig.model_validate({
        "model": model, "mode": "colocated",
        "router": {"grpc_port": free_port(), "worker_event_port": free_port()},
        "colocated": {"num_workers": 1, "num_cpus_per_worker": 1, "base_port": free_port(), "engine": engine},
    })
    cluster = launcher.up(cluster_cfg, say=lambda line: None)
    try:
        with grpc.insecure_channel(cluster.grpc_address) as channel:
            stub = pdserve_pb2_grpc.GenerationStub(channel)
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                     sampling=pb.SamplingParams(max_tokens=tokens, ignore_eos=True))
            itl, last = [], None
            for _ in stub.Generate(req, timeout=600):
                now = time.perf_counter()
                if last is not None:
                    itl.append(now - last)
                last = now
        return itl
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
