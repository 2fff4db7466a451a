"""KV transfer between two engines over each transport: pages streamed in chunks land in the
decode engine's reservation and decoding matches Hugging Face; every failure mode ends in its
one terminal state, and no page stays referenced on either side."""

from __future__ import annotations

import time

import pytest
import torch

from configs import EngineConfig
from engine import LLMEngine, SamplingParams
from engine.kv_transfer import KVReceiver, KVSender, TransferState, TransportError, poll
from engine.kv_transfer.inproc import InProcChannel
from engine.kv_transfer.zmq_transport import ZmqFrameReceiver, ZmqFrameSender
from engine.metrics.peak import Peak
from engine.metrics.worker_metrics import WorkerMetrics
from proto.frame_auth import ClusterSecret
from tests.helpers import DeviceTensor, assert_no_page_leak, hf_greedy

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(params=["inproc", "zmq"])
def link(request):
    """(frame sender, frame receiver, channel or None) for one transport."""
    if request.param == "inproc":
        channel = InProcChannel()
        yield channel.sender, channel.receiver, channel
        return
    secret = ClusterSecret.generate()
    receiver = ZmqFrameReceiver("127.0.0.1", 0, secret)
    sender = ZmqFrameSender(receiver.address, secret, send_timeout_s=2.0)
    yield sender, receiver, None
    sender.close()
    receiver.close()


@pytest.fixture(scope="module")
def pair():
    prefill = LLMEngine(EngineConfig(model="builtin:tiny", page_size=4, max_num_batched_tokens=64, max_num_seqs=8))
    decode = LLMEngine(EngineConfig(model="builtin:tiny", page_size=4))
    return prefill, decode


def prefill_first_token(prefill: LLMEngine, request_id: str, prompt: list[int]) -> int:
    prefill.add_request(request_id, prompt, SamplingParams(max_tokens=1, ignore_eos=True), hold_kv=True)
    first = None
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            first = out.new_token_ids[0]
    return first


def wait_outcome(receiver: KVReceiver, transport, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        outcomes = poll(receiver, transport, 0.05)
        if outcomes:
            return outcomes
    raise AssertionError("no transfer outcome")


def test_streamed_pages_decode_like_hf(link, pair, hf_tiny):
    frame_sender, frame_receiver, _ = link
    prefill, decode = pair
    sender = KVSender(frame_sender, checksum=True)
    receiver = KVReceiver(decode.kv_cache)
    base = [0] + list(range(200, 230))
    skipped = {}
    for request_id, prompt in {"x": base, "y": base[:13] + [3, 4, 5, 6, 7]}.items():
        res = decode.handoff.reserve(request_id, prompt)
        skip = skipped[request_id] = res.num_cached_pages
        receiver.expect(request_id, list(res.page_ids[skip:]), timeout_s=10)
        first = prefill_first_token(prefill, request_id, prompt)
        held = prefill.handoff.held(request_id).page_ids[skip:]
        sender.begin(request_id, timeout_s=10)
        for i in range(0, len(held), 3):  # three pages a frame: streamed, not one blob
            sender.send_pages(request_id, i, prefill.kv_cache.read_pages(list(held[i : i + 3])))
        assert sender.finish(request_id, first) is TransferState.DONE
        prefill.handoff.release(request_id)
        [outcome] = wait_outcome(receiver, frame_receiver)
        assert outcome.state is TransferState.DONE and outcome.first_token == first, outcome
        decode.add_prefilled_request(request_id, prompt, outcome.first_token, GREEDY)
    assert skipped == {"x": 0, "y": 3}  # "y" shares x's first 3 pages: only the rest was sent
    finished = {}
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["x"].token_ids == hf_greedy(hf_tiny, base, 16)[0]
    assert finished["y"].token_ids == hf_greedy(hf_tiny, base[:13] + [3, 4, 5, 6, 7], 16)[0]
    decode.page_manager.reset_prefix_cache()
    assert_no_page_leak(prefill)
    assert_no_page_leak(decode)


def test_corrupted_page_fails_the_transfer():
    """A flipped payload byte fails the transfer, and live metrics count it as reason "corrupt"
    (pdserve_worker_kv_transfer_failures_total{reason="corrupt"}), apart from other failures."""
    channel = InProcChannel()
    prefill = LLMEngine(EngineConfig(model="builtin:tiny", page_size=4))
    decode = LLMEngine(EngineConfig(model="builtin:tiny", page_size=4))
    prompt = [0] + list(range(50, 60))
    res = decode.handoff.reserve("r", prompt)
    records = []
    receiver = KVReceiver(decode.kv_cache, observer=records.append)
    receiver.expect("r", list(res.page_ids), timeout_s=10)
    prefill_first_token(prefill, "r", prompt)
    sender = KVSender(channel.sender, checksum=True)
    sender.begin("r", timeout_s=10)
    channel.corrupt_next_payload = True
    sender.send_pages("r", 0, prefill.kv_cache.read_pages(list(prefill.handoff.held("r").page_ids)))
    assert sender.finish("r") is TransferState.DONE  # the sender cannot know
    prefill.handoff.release("r")
    [outcome] = wait_outcome(receiver, channel.receiver)
    assert outcome.state is TransferState.FAILED and "checksum mismatch" in outcome.detail
    [record] = records
    assert record.state is TransferState.FAILED and record.failure_reason == "corrupt"
    metrics = WorkerMetrics(decode, "decode-0", "decode", Peak.configured(10, 1))
    metrics.observe_transfer(record)
    assert 'reason="corrupt"' in metrics.exposition().decode()
    decode.handoff.cancel("r")
    assert receiver.num_pending == 0
    assert_no_page_leak(prefill)
    assert_no_page_leak(decode)


def test_expired_aborted_incomplete_and_stray(link, pair):
    frame_sender, frame_receiver, _ = link
    _, decode = pair
    receiver = KVReceiver(decode.kv_cache)
    sender = KVSender(frame_sender)
    pages = decode.page_manager.allocate(2)
    receiver.expect("slow", pages[:1], timeout_s=0.05)
    receiver.expect("gone", pages[1:], timeout_s=10)
    sender.begin("gone", timeout_s=10)
    assert sender.abort("gone", "prefill worker died") is TransferState.ABORTED
    time.sleep(0.1)
    outcomes = {o.request_id: o for o in wait_outcome(receiver, frame_receiver)}
    outcomes.update({o.request_id: o for o in receiver.collect()})
    assert outcomes["slow"].state is TransferState.EXPIRED
    assert outcomes["gone"].state is TransferState.ABORTED and outcomes["gone"].detail == "prefill worker died"
    # done before every page arrived is a failure, not a success
    receiver.expect("short", pages, timeout_s=10)
    sender.begin("short", timeout_s=10)
    sender.send_pages("short", 0, decode.kv_cache.read_pages(pages[:1]))
    assert sender.finish("short") is TransferState.DONE
    [outcome] = wait_outcome(receiver, frame_receiver)
    assert outcome.state is TransferState.FAILED and "done after 1 of 2 pages" in outcome.detail
    # frames for a transfer that already ended are counted and dropped
    sender.begin("short", timeout_s=10)
    sender.send_pages("short", 0, decode.kv_cache.read_pages(pages[:1]))
    time.sleep(0.1)
    assert poll(receiver, frame_receiver, 0.5) == [] and receiver.num_stray_frames == 1
    sender.abort("short", "cleanup")
    decode.page_manager.release(pages)


def test_zmq_send_without_a_receiver_fails_fast():
    import socket

    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    frames = ZmqFrameSender(address, ClusterSecret.generate(), send_timeout_s=0.2)
    sender = KVSender(frames)
    sender.begin("r", timeout_s=5)
    import torch

    with pytest.raises(TransportError, match="send timed out"):
        sender.send_pages("r", 0, torch.zeros(2, 1, 1, 4, 1, 8))
    assert sender.abort("r", "no receiver") is TransferState.ABORTED
    frames.close()


def test_staging_buffers_are_reused_only_when_the_transport_is_done():
    import torch

    from engine.kv_transfer.sender import StagingBuffers

    pool = StagingBuffers()
    shape, cpu = (2, 1, 1, 4, 1, 8), torch.device("cpu")
    first = pool.acquire(shape, torch.float32, cpu)
    in_flight = {"done": False}
    pool.release(first, lambda: in_flight["done"])
    assert pool.acquire(shape, torch.float32, cpu) is not first  # still being sent
    in_flight["done"] = True
    assert pool.acquire(shape, torch.float32, cpu) is first
    assert pool.acquire((1,), torch.float32, cpu).shape == (1,)  # other shapes get their own


@pytest.mark.parametrize("first_token", ["7", -1, 2.5, True])
def test_a_done_frame_with_a_bad_first_token_fails_the_transfer(first_token):
    """The final frame's first token joins the request on decode: anything but a token id fails it."""
    from engine.kv_transfer import Frame

    channel = InProcChannel()
    decode = LLMEngine(EngineConfig(model="builtin:tiny", page_size=4, num_pages=8))
    receiver = KVReceiver(decode.kv_cache)
    receiver.expect("r", [], timeout_s=10)  # every page cached: only the done frame travels
    channel.sender.send(Frame({"kind": "done", "request_id": "r", "num_pages": 0, "first_token": first_token}))
    [outcome] = wait_outcome(receiver, channel.receiver)
    assert outcome.state is TransferState.FAILED and "bad first token" in outcome.detail
    assert outcome.first_token is None


def test_a_transfer_that_keeps_sending_pages_outlives_its_lease():
    """The lease bounds the wait for the next page, not the whole transfer: pages arriving every
    0.1 s keep a 0.3 s lease alive for a second; silence after the last one expires it."""
    clock = [0.0]
    decode = LLMEngine(EngineConfig(model="builtin:tiny", page_size=4, num_pages=16))
    receiver = KVReceiver(decode.kv_cache, clock=lambda: clock[0])
    pages = decode.page_manager.allocate(10)
    receiver.expect("slow", pages, timeout_s=0.3)
    receiver.expect("silent", pages[:0], timeout_s=0.3)
    page = decode.kv_cache.read_pages(pages[:1])
    channel = InProcChannel()
    sender = KVSender(channel.sender)
    sender.begin("slow", timeout_s=10)
    for i in range(10):
        clock[0] += 0.1
        sender.send_pages("slow", i, page)
        assert [o.request_id for o in poll(receiver, channel.receiver, 0)] == (["silent"] if i == 2 else [])
    clock[0] += 0.25
    sender.finish("slow", 7)
    [done] = poll(receiver, channel.receiver, 0)
    assert done.state is TransferState.DONE and done.first_token == 7
    decode.page_manager.release(pages)


def test_a_receiver_that_requires_checksums_refuses_a_page_frame_without_one():
    decode = LLMEngine(EngineConfig(model="builtin:tiny", page_size=4, num_pages=8))
    receiver = KVReceiver(decode.kv_cache, require_checksum=True)
    pages = decode.page_manager.allocate(1)
    receiver.expect("r", pages, timeout_s=10)
    channel = InProcChannel()
    sender = KVSender(channel.sender, checksum=False)
    sender.begin("r", timeout_s=10)
    sender.send_pages("r", 0, decode.kv_cache.read_pages(pages))
    [outcome] = wait_outcome(receiver, channel.receiver)
    assert outcome.state is TransferState.FAILED and "without the required checksum" in outcome.detail
    decode.page_manager.release(pages)


def test_frames_without_the_transfer_token_are_ignored_and_tampered_ones_fail():
    """Whoever knows a request id but not its reservation's token can neither fill its pages nor
    end its transfer; a frame whose destination was changed on the way fails its checksum."""
    from engine.kv_transfer.frames import Frame

    decode = LLMEngine(EngineConfig(model="builtin:tiny", page_size=4, num_pages=8))
    receiver = KVReceiver(decode.kv_cache, require_checksum=True)
    pages = decode.page_manager.allocate(2)
    data = decode.kv_cache.read_pages(pages[:1])
    receiver.expect("r", pages, timeout_s=10, token="s3cret")
    channel = InProcChannel()
    forger = KVSender(channel.sender, checksum=True)
    forger.begin("r", timeout_s=10, token="guess")
    forger.send_pages("r", 0, data)
    forger.abort("r", "forged abort")
    real = KVSender(channel.sender, checksum=True)
    real.begin("r", timeout_s=10, token="s3cret")
    real.send_pages("r", 0, data)
    assert poll(receiver, channel.receiver, 0) == [] and receiver.num_stray_frames == 2  # forged, and ignored
    tampered = KVSender(channel.sender, checksum=True)
    tampered.begin("r", timeout_s=10, token="s3cret")
    tampered.send_pages("r", 1, data)  # then moved to another destination page on the way:
    moved = channel.receiver.recv(0)
    assert len(moved) == 1
    receiver.handle(Frame({**moved[0].header, "first_page": 0}, moved[0].payload))
    [outcome] = receiver.collect()
    assert outcome.state is TransferState.FAILED and "checksum mismatch" in outcome.detail
    decode.page_manager.release(pages)


def test_pages_from_device_memory_cross_the_transport_intact(link, pair):
    """Issue 12: page frames built from device memory (a tensor that refuses `.numpy()`, as CUDA
    memory does) go through KVSender, the transport (in-process, and ZMQ on loopback) and
    KVReceiver into the decode cache unchanged, with their checksum."""
    frame_sender, frame_receiver, _ = link
    _, decode = pair
    prompt = [0] + list(range(70, 77))  # 8 tokens: 2 pages of 4
    res = decode.handoff.reserve("dev", prompt)
    receiver = KVReceiver(decode.kv_cache, require_checksum=True)
    receiver.expect("dev", list(res.page_ids), timeout_s=10)
    pages = torch.randn(decode.kv_cache.pages_shape(2), generator=torch.Generator().manual_seed(5))
    pages = pages.to(decode.kv_cache.dtype)
    on_device = pages.clone().as_subclass(DeviceTensor)
    with pytest.raises(TypeError, match="Use Tensor.cpu"):
        on_device.numpy()
    sender = KVSender(frame_sender, checksum=True)
    sender.begin("dev", timeout_s=10)
    sender.send_pages("dev", 0, on_device)
    assert sender.finish("dev", first_token=3) is TransferState.DONE
    [outcome] = wait_outcome(receiver, frame_receiver)
    assert outcome.state is TransferState.DONE and outcome.first_token == 3
    assert torch.equal(decode.kv_cache.read_pages(list(res.page_ids)), pages)
    decode.handoff.cancel("dev")
    assert_no_page_leak(decode)
