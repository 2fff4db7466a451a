"""The torch_dist KV transport on NCCL between two processes, one GPU each: page frames from
rank 0 reach rank 1, which receives from rank 0 by name (NCCL has no receive-from-any-source),
with contents and checksums intact. Skipped with the reason where fewer than two GPUs exist.

Not yet run on GPUs: the one GPU check so far (an H200, 2026-12-04) had one GPU, so it skipped.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist_ranks import run_ranks
from tests.gpu.gpu_env import cuda_devices

# Without CUDA at all the root conftest's reason ("needs CUDA") is the one shown.
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(0 < cuda_devices() < 2, reason=f"needs 2 GPUs for NCCL p2p; this machine has {cuda_devices()}")]

PAGES = (2, 4, 1, 16, 8, 128)  # read_pages layout: [2, layers, pages, page_size, kv_heads, head_dim]


def _rank_main(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    from engine.kv_transfer import torch_dist
    from engine.kv_transfer.frames import page_checksum, pages_frame

    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    device = f"cuda:{rank}"
    torch.cuda.set_device(rank)
    torch_dist.join_group(rank, 2, f"127.0.0.1:{port}", "nccl", timeout_s=120)
    try:
        if rank == 0:
            sender = torch_dist.DistFrameSender(torch_dist.address_of(1), device)
            for page in range(3):
                sender.send(pages_frame("r", page, torch.full(PAGES, float(page), device=device), checksum=True))
            results.put(("flushed", sender.flush(60)))
        else:
            receiver = torch_dist.DistFrameReceiver([0], device)
            frames = []
            while len(frames) < 3:
                frames += receiver.recv(1.0)
            results.put(("got", sorted((f.header["first_page"], torch.frombuffer(bytearray(f.payload), dtype=torch.float32)
                                        .unique().tolist(), page_checksum(f.header, f.payload) == f.header["crc32"])
                                       for f in frames)))
        dist.barrier(device_ids=[rank])
    finally:
        torch_dist.leave_group()


def test_nccl_pages_reach_the_rank_that_names_its_source():
    reports, _ = run_ranks(_rank_main, 2, 2, "a rank reported nothing", timeout_s=180)
    got = dict(reports)
    assert got["flushed"] is True
    assert got["got"] == [(page, [float(page)], True) for page in range(3)]
