"""The torch.distributed KV transport on gloo (the same code runs NCCL on GPUs): a decode rank
receives from the prefill ranks it names, never from "any source" (NCCL rejects that), and
page frames are built from device memory through a host copy, not `.numpy()` on the device."""

from __future__ import annotations

import os

import pytest
import torch

from engine.kv_transfer.frames import page_checksum, pages_frame
from tests.dist_ranks import SPAWN, run_ranks
from tests.helpers import DeviceTensor

WORLD = 3  # ranks 0 and 1 prefill, rank 2 decode
PAGES = (2, 1, 1, 4, 1, 8)  # KVCache.read_pages layout: [2, layers, kv_heads, pages, page_size, d]


def _rank_main(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    from engine.kv_transfer import torch_dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch_dist.join_group(rank, WORLD, f"127.0.0.1:{port}", "gloo", timeout_s=60)
    try:
        if rank < 2:
            sender = torch_dist.DistFrameSender(torch_dist.address_of(2))
            for page in range(3):
                data = torch.full(PAGES, float(10 * rank + page))
                sender.send(pages_frame(f"r{rank}", page, data, checksum=True))
        else:
            errors = []
            for bad in ([], [2], [0, 5]):
                try:
                    torch_dist.DistFrameReceiver(bad)
                except ValueError as exc:
                    errors.append(str(exc))
            receiver = torch_dist.DistFrameReceiver([0, 1])
            frames = []
            while len(frames) < 6:
                frames += receiver.recv(1.0)
            got = sorted((f.header["request_id"], f.header["first_page"], torch.frombuffer(
                bytearray(f.payload), dtype=torch.float32).unique().tolist(), page_checksum(f.header, f.payload)
                == f.header["crc32"]) for f in frames)
            results.put((errors, got))
        dist.barrier()
    finally:
        torch_dist.leave_group()


def test_decode_rank_receives_from_the_prefill_ranks_it_names():
    [(errors, got)], exitcodes = run_ranks(_rank_main, WORLD, 1, "the decode rank received no frames")
    assert len(errors) == 3 and all("must be other ranks of the group of 3" in e for e in errors)
    assert got == [(f"r{rank}", page, [float(10 * rank + page)], True) for rank in (0, 1) for page in range(3)]
    # The prefill ranks leave cleanly. The decode rank is not checked: its receive threads are
    # still blocked in gloo's recv when the group is torn down, which ends that process
    # ("terminate called"); a worker does that only when it stops anyway.
    assert exitcodes[:2] == [0, 0]


def test_a_page_frame_from_device_memory_goes_through_a_host_copy():
    host = torch.arange(64, dtype=torch.float32).view(PAGES)
    on_device = host.clone().as_subclass(DeviceTensor)
    with pytest.raises(TypeError, match="Use Tensor.cpu"):
        on_device.numpy()  # what pages_frame used to call
    frame = pages_frame("r", 3, on_device, checksum=True)
    assert bytes(frame.payload) == host.numpy().tobytes()
    assert frame.header["crc32"] == pages_frame("r", 3, host, checksum=True).header["crc32"]


BIG = (2, 1, 1, 4, 16, 8192)  # 4 MiB of float32 pages: more than a socket buffer holds


def _pair_main(rank: int, port: int, results, receiving) -> None:
    """Rank 0 sends while rank 1 is not receiving yet; rank 1 starts when told."""
    import time

    import torch.distributed as dist

    from engine.kv_transfer import torch_dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch_dist.join_group(rank, 2, f"127.0.0.1:{port}", "gloo", timeout_s=60)
    try:
        if rank == 0:
            sender = torch_dist.DistFrameSender(torch_dist.address_of(1))
            start = time.monotonic()
            reusable = [sender.send(pages_frame("big", i, torch.full(BIG, float(i)), checksum=True))
                        for i in range(3)]
            sent_s = time.monotonic() - start
            left_before = [r() for r in reusable]
            flushed_early = sender.flush(0.2)  # nobody is receiving: this must time out
            receiving.set()
            flushed = sender.flush(60)
            results.put(("send", sent_s, left_before, flushed_early, flushed, [r() for r in reusable]))
        else:
            receiving.wait(60)
            receiver = torch_dist.DistFrameReceiver([0])
            frames = []
            while len(frames) < 3:
                frames += receiver.recv(1.0)
            results.put(("recv", [(f.header["first_page"], torch.frombuffer(bytearray(f.payload), dtype=torch.float32)
                                   .unique().tolist(), page_checksum(f.header, f.payload) == f.header["crc32"])
                                  for f in frames]))
        dist.barrier()
    finally:
        torch_dist.leave_group()


def test_sends_return_before_the_peer_receives_and_flush_waits_for_them():
    """The prefill step loop is not held by a decode rank that is not receiving: `send` posts
    the frame and returns; the returned callable and `flush` say when the pages' memory is free."""
    reports, _ = run_ranks(_pair_main, 2, 2, "a rank reported nothing", SPAWN.Event())
    got = {report[0]: report[1:] for report in reports}
    sent_s, left_before, flushed_early, flushed, done_after = got["send"]
    assert sent_s < 5.0  # a blocking send would wait for the receiver, which waits for flush
    assert not all(left_before) and flushed_early is False  # 12 MiB cannot have left yet
    assert flushed is True and all(done_after)
    assert got["recv"] == ([(i, [float(i)], True) for i in range(3)],)


def test_the_preamble_carries_the_header_and_payload_length():
    from engine.kv_transfer.frames import MAX_HEADER_BYTES
    from engine.kv_transfer.torch_dist import PREAMBLE_BYTES, decode_preamble, encode_preamble, heartbeat_preamble
    from engine.kv_transfer.transport import TransportError

    assert decode_preamble(heartbeat_preamble()) == (b"", 0)  # a heartbeat: no header, no payload
    preamble = encode_preamble(b"\x81\xa4kind\xa4done", 12345)
    assert preamble.shape == (PREAMBLE_BYTES,)
    assert decode_preamble(preamble) == (b"\x81\xa4kind\xa4done", 12345)
    with pytest.raises(TransportError, match="at most"):
        encode_preamble(b"x" * (MAX_HEADER_BYTES + 1), 0)
    bad = preamble.clone()
    bad[:8].view(torch.int64)[0] = MAX_HEADER_BYTES + 1  # a desynchronised or hostile stream
    with pytest.raises(ValueError, match="preamble"):
        decode_preamble(bad)
    bad = preamble.clone()
    bad[8:16].view(torch.int64)[0] = -1
    with pytest.raises(ValueError, match="preamble"):
        decode_preamble(bad)


GROUP_TIMEOUT_S = 2.0  # shortened: the default is 120 s


def _idle_main(rank: int, port: int, results) -> None:
    """A frame, then 3x the group timeout with nothing to send, then another frame."""
    import time

    from engine.kv_transfer import torch_dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch_dist.join_group(rank, 2, f"127.0.0.1:{port}", "gloo", timeout_s=GROUP_TIMEOUT_S)
    if rank == 0:
        sender = torch_dist.DistFrameSender(torch_dist.address_of(1), heartbeat_s=GROUP_TIMEOUT_S / 4)
        sender.send(pages_frame("before", 0, torch.ones(PAGES), checksum=True))
        time.sleep(3 * GROUP_TIMEOUT_S)
        sender.send(pages_frame("after", 0, torch.ones(PAGES), checksum=True))
        results.put(("send", sender.flush(10), sender.link_error(), sender.num_heartbeats))
    else:
        receiver = torch_dist.DistFrameReceiver([0])
        got: list[str] = []
        deadline = time.monotonic() + 6 * GROUP_TIMEOUT_S
        while len(got) < 2 and time.monotonic() < deadline:
            got += [f.header["request_id"] for f in receiver.recv(0.2)]
        results.put(("recv", got, receiver.link_errors(), receiver.num_heartbeats))
    time.sleep(0.5)
    os._exit(0)  # not leave_group: the receive threads are still blocked in gloo (see above)


def test_an_idle_link_outlives_three_group_timeouts():
    """gloo bounds every receive by the group timeout, and one that runs past it closes the pair
    for good (before the heartbeat, the second frame failed with "Connection closed by peer"):
    the idle sender's heartbeats keep the posted receive under it, and are never seen as frames."""
    reports, _ = run_ranks(_idle_main, 2, 2, "a rank reported nothing")
    got = {report[0]: report[1:] for report in reports}
    flushed, error, beats_sent = got["send"]
    frames, errors, beats_received = got["recv"]
    assert flushed is True and error is None and frames == ["before", "after"] and errors == {}
    assert beats_sent >= 8 and beats_received == beats_sent  # ~12 in 6 s at 0.5 s


def _death_main(rank: int, port: int, results) -> None:
    """Rank 1 (decode) stops reading (SIGSTOP-like: never posts receives and exits late); rank
    0's heartbeat finds the link dead. Then the roles swap: a sender that dies is seen by the
    receiver as a source it no longer hears."""
    import time

    from engine.kv_transfer import torch_dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch_dist.join_group(rank, 3, f"127.0.0.1:{port}", "gloo", timeout_s=GROUP_TIMEOUT_S)
    if rank == 0:  # sends to rank 1, which exits without reading
        sender = torch_dist.DistFrameSender(torch_dist.address_of(1), heartbeat_s=0.2)
        deadline = time.monotonic() + 10
        while sender.link_error() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        results.put(("sender", sender.link_error()))
        time.sleep(8)
    elif rank == 1:  # exits: its connections close
        time.sleep(0.5)
        os._exit(0)
    else:  # rank 2 reads rank 1, which dies
        receiver = torch_dist.DistFrameReceiver([1])
        deadline = time.monotonic() + 10
        while not receiver.link_errors() and time.monotonic() < deadline:
            time.sleep(0.05)
        results.put(("receiver", receiver.link_errors()))
    time.sleep(0.5)
    os._exit(0)


def test_a_dead_link_is_reported_by_its_sender_and_by_its_receiver():
    reports, _ = run_ranks(_death_main, 3, 2, "a rank reported nothing")
    got = dict(reports)
    assert "torch.distributed send to rank 1 failed" in got["sender"]
    assert list(got["receiver"]) == ["dist:1"] and "receive failed" in got["receiver"]["dist:1"]
    with pytest.raises(ValueError, match="heartbeat_s must be > 0"):
        from engine.kv_transfer.torch_dist import DistFrameSender
        DistFrameSender("dist:1", heartbeat_s=0)
