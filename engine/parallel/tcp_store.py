"""The TCP store a torch.distributed group rendezvous on, listening on its configured host only.

Used by the torch_dist KV transport's group (engine/kv_transfer/torch_dist.py) and by each TP x
PP worker's shard group (engine/parallel/layout.py). Rank 0 hosts the store; every other rank
connects to it.

Why not `dist.TCPStore(host, port, is_master=True)` (or `init_method="tcp://host:port"`, which
makes one): torch 2.13's store server ignores `host` and listens on every interface, with the
libuv backend and the classic one alike (`ss -ltn` shows `*:PORT` for a store made for
127.0.0.1), so a loopback cluster's store would answer the network. Here rank 0 binds the
listening socket itself, on `host`, and hands it to torch (`master_listen_fd`, which both
backends take on Linux and listen on as given). Clients are unchanged.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist


def open_tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """The group's store at host:port: hosted here (listening on `host` only; port 0 = a free
    port, read back from `.port`) when `is_master`, else a connection to it (retried until
    `timeout_s`, so ranks may start in any order)."""
    timeout = timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout, wait_for_workers=False)
    listener = _bind(host, port)
    port = listener.getsockname()[1]
    inode = os.fstat(listener.fileno()).st_ino
    fd = listener.detach()  # torch's server owns the socket from here and closes it with the store
    try:
        # wait_for_workers=False: the process group's own rendezvous waits for the other ranks.
        return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                             master_listen_fd=fd)
    except BaseException:
        _close_if_still_ours(fd, inode)
        raise


def _bind(host: str, port: int) -> socket.socket:
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As torch's own listener does: a replacement worker rebinds its configured port at once,
        # not after the old connections' TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"the torch.distributed store cannot listen on {host}:{port}: {exc.strerror} "
                                 "(rank 0 must run where that address is)") from exc
    return sock


def _close_if_still_ours(fd: int, inode: int) -> None:
    """Closes `fd` after a failed store start unless torch already closed it: a number torch
    released may by now name another thread's file, which must not be closed."""
    try:
        if os.fstat(fd).st_ino == inode:
            os.close(fd)
    except OSError:
        pass
