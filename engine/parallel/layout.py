"""Where one shard of a tensor- and pipeline-parallel worker sits, and the group it talks over.

A worker with TP x PP > 1 is a group of processes (Ray actors in one placement group, or
local subprocesses in tests), rank r = pp_rank * tp_size + tp_rank. Rank 0 is the driver: it
runs the scheduler, the sampler and the worker's sockets; every rank holds the weights and KV
of its attention heads (tensor parallel) and its layers (pipeline parallel). engine/parallel/shard_executor.py
runs a step across the group; this module only answers "which heads, which layers, which
peers" and opens the torch.distributed process groups.

The groups are explicit ProcessGroup objects on their own TCP store, never the default group:
the torch_dist KV transport (engine/kv_transfer/torch_dist.py) owns the default group, and
one process takes part in both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.model.config import ModelConfig
from engine.parallel.tcp_store import open_tcp_store


@dataclass(frozen=True)
class ShardLayout:
    """This rank's slice of the model: heads and layers, and its neighbours' ranks."""

    tp_size: int
    pp_size: int
    rank: int

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def rank_of(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank

    def stage_layers(self, num_layers: int, pp_rank: int | None = None) -> range:
        """Layers of a stage: contiguous, the first `num_layers % pp_size` stages one longer."""
        pp_rank = self.pp_rank if pp_rank is None else pp_rank
        base, extra = divmod(num_layers, self.pp_size)
        start = pp_rank * base + min(pp_rank, extra)
        return range(start, start + base + (1 if pp_rank < extra else 0))

    def kv_heads(self, num_kv_heads: int, tp_rank: int | None = None) -> slice:
        tp_rank = self.tp_rank if tp_rank is None else tp_rank
        per = num_kv_heads // self.tp_size
        return slice(tp_rank * per, (tp_rank + 1) * per)

    def check_model(self, cfg: ModelConfig) -> None:
        """The model must split evenly; says which number does not."""
        for what, n in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                        ("intermediate_size", cfg.intermediate_size)):
            if n % self.tp_size:
                raise ValueError(f"tensor_parallel_size={self.tp_size} does not divide the model's {what} ({n})")
        if cfg.num_layers < self.pp_size:
            raise ValueError(f"pipeline_parallel_size={self.pp_size} exceeds the model's {cfg.num_layers} layers")

    def page_bytes(self, cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        """Bytes of one page on the most loaded rank: every rank holds the same page ids, so
        the budget is set by the rank with the most layers."""
        layers = max(len(self.stage_layers(cfg.num_layers, p)) for p in range(self.pp_size))
        kv_heads = cfg.num_kv_heads // self.tp_size
        return 2 * layers * kv_heads * cfg.head_dim * page_size * (torch.finfo(dtype).bits // 8)


class ShardGroup:
    """The process groups of one TP x PP worker: `world` (all ranks: step commands, KV pages,
    pipeline hand-offs) and `tp` (this stage's tensor-parallel ranks: all-reduce)."""

    def __init__(self, layout: ShardLayout, store: dist.Store, backend: str = "gloo",
                 timeout_s: float = 120.0) -> None:
        self.layout = layout
        self._store = store
        timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        # Every collective, including a follower's wait for the next command, fails after
        # timeout_s: an idle driver sends keep-alives (shard_executor.GroupDriver), a dead one
        # ends its followers instead of leaving them blocked forever.
        self.world = _new_group(backend, dist.PrefixStore("world", store), layout.rank, layout.world_size, timeout)
        self.tp = None
        if layout.tp_size > 1:
            self.tp = _new_group(backend, dist.PrefixStore(f"tp{layout.pp_rank}", store), layout.tp_rank,
                                 layout.tp_size, timeout)
        self.device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")

    @staticmethod
    def open_store(layout: ShardLayout, store_address: str, timeout_s: float = 120.0) -> dist.TCPStore:
        """The group's rendezvous: rank 0 hosts it at store_address, listening on that host only
        (port 0 = any free port, read back from `.port`), the others connect to it."""
        host, port = store_address.rsplit(":", 1)
        if host.startswith("127."):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # a loopback group: keep gloo on lo
        return open_tcp_store(host, int(port), layout.world_size, layout.rank == 0, timeout_s)

    @classmethod
    def join(cls, layout: ShardLayout, store_address: str, backend: str = "gloo",
             timeout_s: float = 120.0) -> ShardGroup:
        """Blocks until every rank of the worker has joined (or timeout_s passes)."""
        return cls(layout, cls.open_store(layout, store_address, timeout_s), backend, timeout_s)

    # -- collectives, always on explicit groups ----------------------------------------------
    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """From the driver (rank 0) to every rank."""
        self.world.broadcast(tensor, 0).wait()
        return tensor

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.world.send([tensor], dst, 0).wait()

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self.world.recv([tensor], src, 0).wait()
        return tensor

    def tp_all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:
            self.tp.allreduce([tensor]).wait()
        return tensor

    def close(self) -> None:
        # Dropping the references tears the gloo pairs down; the store goes with rank 0.
        self.world = self.tp = None


def _new_group(backend: str, store, rank: int, size: int, timeout: timedelta):
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise ValueError(f"unknown torch.distributed backend {backend!r}; choose 'gloo' or 'nccl'")
