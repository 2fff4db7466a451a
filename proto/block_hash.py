"""Content addressing of full KV pages: a chained hash over token ids, the same in every process.

Used by the page manager to find pages whose KV is already computed (engine/page_manager.py),
and by the router to find which worker holds how much of a prompt (router/placement/block_index.py,
fed by the workers' KVBlocks events, proto/worker_messages.py): a contract between processes,
so it lives here. A page's hash covers its own tokens and (through the parent hash) every token
before it, so equal hashes mean equal KV. sha256 over a fixed byte encoding, never Python's
salted `hash()`: a prefill worker, a decode worker and the router must compute the same
identity for the same prefix. Events carry `short_hash`, 63 bits of the digest as an int:
the router only routes by it, and the pages' full hashes are checked where the pages are.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = b"pdserve-prefix-v1"


def hash_page(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Hash of one full page given its parent's hash."""
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def hash_full_pages(token_ids: Sequence[int], page_size: int, start_page: int = 0,
                    parent: bytes = ROOT_HASH) -> list[bytes]:
    """Hashes of the full pages of `token_ids`, from `start_page` on, chained from `parent`."""
    hashes = []
    for page in range(start_page, len(token_ids) // page_size):
        parent = hash_page(parent, token_ids[page * page_size : (page + 1) * page_size])
        hashes.append(parent)
    return hashes


def short_hash(page_hash: bytes) -> int:
    """63 bits of a page hash's first 8 bytes, as a non-negative int (what KV block events
    carry: a msgpack int that every message check takes)."""
    return int.from_bytes(page_hash[:8], "little") & ((1 << 63) - 1)
