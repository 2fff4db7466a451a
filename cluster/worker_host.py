"""Hosts one worker role with its engine and sockets on a background thread: what each Ray
worker actor runs (and what tests start directly). Composition only: engine + role + sockets +
loop, and, with a metrics port, the worker's Prometheus /metrics (engine/metrics/worker_metrics.py) fed by the
engine's step observer and the KV transfer observers. Every socket it opens signs or checks
messages under the spec's cluster secret (proto/frame_auth.py); what its loops drop is counted in
`rejections` (engine/metrics/rejected.py), served at /metrics and in `state()`.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import uuid
from collections.abc import Callable

from cluster.role_switch.switchable_worker import SwitchableWorker
from cluster.serving_loop import EventSink, serve
from cluster.specs import NODE_IP, WorkerSpec
from decode_worker.colocated import ColocatedWorker
from decode_worker.worker import DecodeWorker
from engine import LLMEngine
from engine.block_events import BlockEventLog
from engine.kv_transfer import torch_dist
from engine.kv_transfer.destinations import KVDestinations
from engine.kv_transfer.links import KVLinks
from engine.kv_transfer.multi_receiver import MultiFrameReceiver
from engine.kv_transfer.transport import BaseFrameReceiver, BaseFrameSender
from engine.kv_transfer.zmq_transport import ZmqFrameReceiver, ZmqFrameSender
from engine.metrics.peak import Peak, resolve_peak
from engine.metrics.rates import StepRates
from engine.metrics.rejected import RejectedMessages
from engine.metrics.worker_metrics import WorkerMetrics
from engine.parallel.layout import ShardGroup, ShardLayout
from engine.parallel.shard_follower import group_backend
from prefill_worker.worker import PrefillWorker
from proto import worker_messages as wm
from proto.flight.dump import render
from proto.flight.recorder import FlightRecorder

log = logging.getLogger(__name__)
Emit = Callable[[object], None]


class WorkerHost:
    def __init__(self, spec: WorkerSpec, peak: Peak | None = None,
                 event_tap: Callable[[Emit], Emit] | None = None) -> None:
        """`spec`: what this worker is (cluster/specs.py); `peak`: what MBU / MFU are measured
        against (None = the spec's configured peaks, or measured now, engine/metrics/peak.py);
        `event_tap`: wraps the role's `emit` (tests inject faults through it; anything it raises
        ends the worker as a crash would, tests/fault_injection.py)."""
        if spec.host == NODE_IP:
            raise ValueError("resolve the node's address before hosting a worker (WorkerActor does)")
        self.spec = spec
        self._event_tap = event_tap
        self.crashed = False
        self.incarnation = uuid.uuid4().hex  # in every heartbeat: the router tells a replacement apart
        self.role, self.worker_id = spec.role, spec.worker_id
        self.command_address = spec.command_address
        self.metrics_port = spec.metrics_port
        self._stop = threading.Event()
        self._go = threading.Event()  # start() lets the built engine serve
        self._built = threading.Event()
        self._ready = threading.Event()
        self.error: BaseException | None = None
        # Prefill: where KV may go. Empty until the process that started this worker says
        # (set_kv_destinations), so nothing is pushed anywhere before then.
        self.kv_destinations = KVDestinations()
        self.rejections = RejectedMessages()  # internal messages the loops dropped, by (socket, reason)
        # Its commands, events and state changes per request (proto/flight/): dumped on SIGUSR1 or
        # `pdserve debug dump`; the header is what `pdserve replay` rebuilds this role from.
        self.recorder = FlightRecorder(spec.role, spec.worker_id, spec.flight.capacity, header={
            "engine": spec.engine.model_dump(mode="json"), "kv_address": spec.kv_address,
            "switchable": spec.switchable}) \
            if spec.flight.enabled else None
        self._role = None  # the role object, once the serving thread made it
        self.engine: LLMEngine | None = None
        self.metrics: WorkerMetrics | None = None
        # The engine is built on the thread that will step it: torch's OpenMP thread pool
        # belongs to the thread that first runs a parallel region, and a pool left behind by
        # a loading thread spun beside the serving one, slowing every decode step by 15-25%
        # on a 2-core machine (both pools competing for the same cores).
        self._thread = threading.Thread(target=self._run, args=(peak,), name=f"pdserve-{spec.worker_id}", daemon=True)
        self._thread.start()
        self._built.wait()
        if self.error is not None:
            raise self.error

    def _build(self, peak: Peak | None) -> None:
        engine_config, shard_store_address = self.spec.engine, self.spec.shard_store_address
        group = None
        if engine_config.world_size > 1:
            if shard_store_address is None:
                raise ValueError(f"a worker with {engine_config.world_size} shards needs a shard_store_address")
            layout = ShardLayout(engine_config.tensor_parallel_size, engine_config.pipeline_parallel_size, 0)
            group = ShardGroup.join(layout, shard_store_address, group_backend(engine_config))
        self.engine = LLMEngine(engine_config, group)
        self.rates = StepRates()  # this worker's measured speed, in its heartbeats (router/placement/)
        self.engine.add_step_observer(self.rates.observe)
        self.block_events = BlockEventLog()  # its prefix cache's changes, for the router's KV block index
        self.engine.page_manager.block_events = self.block_events
        if self.metrics_port is not None:
            peak = peak or resolve_peak(self.spec.peak_memory_bandwidth_gbps, self.spec.peak_tflops,
                                        engine_config.device, engine_config.dtype)
            self.metrics = WorkerMetrics(self.engine, self.worker_id, self.role, peak, rejected=self.rejected_messages)
            self.engine.add_step_observer(self.metrics.observe_step)

    def start(self, timeout_s: float = 30.0) -> None:
        if self.metrics is not None:
            self.metrics.serve(self.spec.host, self.metrics_port)
        self._go.set()
        if not self._ready.wait(timeout_s) or self.error is not None:
            raise RuntimeError(f"worker {self.worker_id} did not start: {self.error or 'timed out'}")

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._go.set()  # a host stopped before it started leaves its thread too
        self._thread.join(timeout_s)
        self.engine.close()  # a sharded engine's followers leave their loop
        if self.metrics is not None:
            self.metrics.close()

    def set_kv_destinations(self, addresses: tuple[str, ...]) -> None:
        """The KV addresses of the cluster's decode workers, now (cluster/kv_destinations.py):
        the only destinations this prefill worker accepts. Safe from any thread."""
        if self.role != "prefill" and not self.spec.switchable:
            raise ValueError(f"{self.worker_id} sends no KV: only prefill (and switchable) workers take KV "
                             "destinations")
        # A switchable worker never ships KV to itself (the router never pairs it with itself).
        self.kv_destinations.replace(tuple(a for a in addresses if a != self.spec.kv_address))

    @property
    def current_role(self) -> str:
        """The role taking new work now: a switchable worker's last flip, else the one it started as."""
        return self._role.role if isinstance(self._role, SwitchableWorker) else self.role

    def page_stats(self) -> dict[str, int]:
        return self.engine.snapshot.page_stats()

    def held_request_ids(self) -> frozenset[str]:
        """Every request id this worker holds anything for: engine sequences, held or reserved
        pages, prefill jobs, KV transfers in or out. As of the serving loop's last turn (safe
        from any thread); empty once every request has ended: what a leak check asserts."""
        return self.engine.snapshot.request_ids | getattr(self._role, "held_ids", frozenset())

    def flight_dump(self, reason: str = "asked") -> str:
        """This worker's flight recorder dump (proto/flight/dump.py), as text; "" when it has none."""
        return "" if self.recorder is None else render(self.recorder, reason)

    def rejected_messages(self) -> dict[tuple[str, str], int]:
        """(socket, reason) -> messages dropped: the loops' counts plus the role's refused
        commands (a prefill worker's unknown KV destinations). Safe from any thread."""
        counts = self.rejections.snapshot()
        for reason, n in dict(getattr(self._role, "rejected", {})).items():
            counts["commands", reason] = counts.get(("commands", reason), 0) + n
        return counts

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def state(self) -> dict:
        """Queues and KV pages, read from another thread (a snapshot; may be a step behind)."""
        snap = self.engine.snapshot
        return {"running": snap.num_running, "waiting": snap.num_waiting, "kv_pages": snap.page_stats(),
                "serving_as": self.current_role,  # as the worker itself says (a switchable one's last SetRole)
                "late_commands": dict(getattr(self._role, "late_commands", {})),  # the old role's, served after a flip
                "rejected": dict(getattr(self._role, "rejected", {})),  # refused commands by reason
                "rejected_messages": _nested(self.rejected_messages()),  # every dropped message: {socket: {reason: n}}
                "error": None if self.error is None else f"{type(self.error).__name__}: {self.error}"}

    def _run(self, peak: Peak | None) -> None:
        try:
            self._build(peak)
        except BaseException as exc:  # noqa: BLE001 - re-raised by __init__
            self.error = exc
            return
        finally:
            self._built.set()
        self._go.wait()
        if self._stop.is_set():
            return
        # Sockets are created, used and closed on this thread only (ZMQ sockets are not
        # thread-safe).
        secret = self.spec.cluster_secret
        events = EventSink(self.spec.router_event_address, secret, self.worker_id, recorder=self.recorder)
        closers = [events.close]
        try:
            role = self._role = self._make_role(self._event_tap(events.emit) if self._event_tap else events.emit,
                                                closers)
            if self.recorder is not None:
                for events_log in getattr(role, "logs", (role.log,)):
                    events_log.tap = self.recorder.state
            serve(role, self.command_address, events, self._load(role), self._stop, secret,
                  on_reject=self.rejections.count, on_ready=self._ready.set, notices=self._block_notices)
        except BaseException as exc:  # noqa: BLE001 - the serving loop died, so the worker is dead
            self.crashed, self.error = True, exc
            # Heartbeats stop with the loop: the router must see a dead worker, never a zombie
            # that beats while nothing serves (the supervisor then replaces it).
            self._stop.set()
            self._ready.set()
            log.error("worker %s: serving loop ended by %s: %s", self.worker_id, type(exc).__name__, exc)
        finally:
            for close in closers:
                close()

    def _make_role(self, emit, closers):
        observe_transfer = self.metrics.observe_transfer if self.metrics is not None else None
        if self.role == "colocated":
            return ColocatedWorker(self.worker_id, self.engine, emit)
        device = self.engine.config.device
        spec = self.spec
        if spec.kv_transport == "torch_dist":
            rank, world_size, store = spec.dist_rank, spec.dist_world_size, spec.dist_store_address
            if spec.host.startswith("127.") and "GLOO_SOCKET_IFNAME" not in os.environ:
                os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # a loopback cluster: keep gloo on lo
            torch_dist.join_group(rank, world_size, store, backend="nccl" if device.startswith("cuda") else "gloo",
                                  timeout_s=spec.dist_timeout_s)
            closers.append(torch_dist.leave_group)
        if spec.switchable:  # both roles on one engine, either taking new work (cluster/role_switch/)
            return SwitchableWorker(self._prefill_role(emit, closers, observe_transfer),
                                    self._decode_role(emit, closers, observe_transfer), self.role)
        if self.role == "decode":
            return self._decode_role(emit, closers, observe_transfer)
        return self._prefill_role(emit, closers, observe_transfer)

    def _decode_role(self, emit, closers, observe_transfer) -> DecodeWorker:
        spec, device = self.spec, self.engine.config.device
        zmq_receiver = ZmqFrameReceiver(spec.host, spec.kv_port, spec.cluster_secret,
                                        sign_payload=not spec.kv_checksum, on_reject=self.rejections.count)
        receiver: BaseFrameReceiver = zmq_receiver
        if spec.kv_transport == "torch_dist":  # ZMQ stays bound: the pairs whose dist link died use it
            receiver = MultiFrameReceiver(torch_dist.DistFrameReceiver(spec.dist_sources, device), zmq_receiver)
        closers.insert(0, receiver.close)  # before the group is left: its receive threads end then
        return DecodeWorker(self.worker_id, self.engine, receiver, receiver.address, emit,
                            transfer_observer=observe_transfer, max_lease_s=spec.max_lease_s,
                            require_checksum=spec.kv_checksum)

    def _prefill_role(self, emit, closers, observe_transfer) -> PrefillWorker:
        spec, device = self.spec, self.engine.config.device

        def open_frames(address: str) -> BaseFrameSender:
            if address.startswith(torch_dist.PREFIX):
                return torch_dist.DistFrameSender(address, device, heartbeat_s=spec.link_heartbeat_s)
            return ZmqFrameSender(address, spec.cluster_secret, self.worker_id, sign_payload=not spec.kv_checksum,
                                  heartbeat_s=spec.link_heartbeat_s)

        links = KVLinks(open_frames, checksum=spec.kv_checksum, observer=observe_transfer)
        # Every torch_dist link from the start (not on first use): its heartbeat keeps the
        # decode rank's posted receive under the group timeout even if no request ever uses it.
        links.keep(torch_dist.address_of(rank) for rank in spec.dist_sinks)
        closers.insert(0, links.close)
        return PrefillWorker(self.worker_id, self.engine, links, emit, self.kv_destinations,
                             max_transfer_s=spec.max_transfer_s)

    def _block_notices(self) -> list[object]:
        changes = self.block_events.take()
        if changes is None:
            return []
        return [wm.KVBlocks(self.worker_id, self.incarnation, changes.seq, changes.stored, changes.removed,
                            changes.lost)]

    def _load(self, role):
        engine, worker_id, name, incarnation, rates = self.engine, self.worker_id, self.role, self.incarnation, self.rates
        cache = engine.kv_cache
        kv_bytes_per_token = math.prod(cache.pages_shape(1)) * cache.dtype.itemsize // engine.config.page_size

        def load() -> wm.Load:
            snap = engine.snapshot
            now = role.role if isinstance(role, SwitchableWorker) else name  # the role taking new work
            prefill = role.prefill if isinstance(role, SwitchableWorker) else role
            decode = role.decode if isinstance(role, SwitchableWorker) else role
            # Prompt tokens waiting to be computed here: a prefill worker's jobs, a decode
            # worker's own prompts (placed on it by the router).
            queued = prefill.queued_tokens if now == "prefill" else snap.pending_prompt_tokens
            links: tuple[wm.KVLink, ...] = ()
            if isinstance(prefill, PrefillWorker):
                links += tuple(wm.KVLink(s.address, s.up, s.error or "", s.bytes_per_s, s.latency_s)
                               for s in prefill.link_states)
            if isinstance(decode, DecodeWorker):
                links += tuple(wm.KVLink(address, False, why[:500]) for address, why in decode.dead_sources.items())
            return wm.Load(worker_id, now, queued, snap.free_pages, snap.num_running, incarnation, links,
                           rates.prefill_tokens_per_s, rates.decode_step_s, kv_bytes_per_token)

        return load


def _nested(counts: dict[tuple[str, str], int]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for (socket, reason), n in sorted(counts.items()):
        out.setdefault(socket, {})[reason] = n
    return out
