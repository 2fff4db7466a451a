"""Content addressing of full KV pages: a chained hash over token ids.

Used by the page manager to find pages whose KV is already computed. A page's hash covers its
own tokens and (through the parent hash) every token before it, so equal hashes mean equal KV.
sha256 over a fixed byte encoding, never Python's salted `hash()`: a prefill worker and a decode
worker in different processes must compute the same identity for the same prefix.
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
