"""Ownership of KV pages that cross engines: held KV on the prefill side, reservations on the
decode side. Transport-free; the workers move the bytes (KVCache.read_pages / write_pages).

The disaggregated flow for one request (docs/design.md §2), each call made exactly once:
    decode:  res = decode.handoff.reserve(rid, prompt)     # pages to land in (None: full, retry)
    prefill: prefill.add_request(rid, prompt, SamplingParams(max_tokens=1), hold_kv=True)
             ... step until it finishes with the first token; its pages are now held ...
    move:    data = prefill.kv_cache.read_pages(prefill.handoff.held(rid).page_ids[res.num_cached_pages:])
             decode.kv_cache.write_pages(res.page_ids[res.num_cached_pages:], data)
    prefill: prefill.handoff.release(rid)                  # or on failure/expiry: same call
    decode:  decode.add_prefilled_request(rid, prompt, first_token, params)   # or handoff.cancel(rid)
Invariants: every page taken here is referenced once by the handoff until `release`, `cancel`,
`drop` or `add_prefilled_request` hands it back or on; unknown or repeated ids raise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.page_manager import PageManager
from proto.block_hash import hash_full_pages


@dataclass(frozen=True)
class HeldKV:
    page_ids: tuple[int, ...]
    num_tokens: int  # tokens whose KV these pages hold, in order


@dataclass(frozen=True)
class Reservation:
    page_ids: tuple[int, ...]  # enough pages for num_tokens
    num_cached_pages: int  # leading pages already holding this prefix here: not to be sent
    num_tokens: int
    page_hashes: tuple[bytes, ...]  # hashes of the cached leading pages


class KVHandoff:
    def __init__(self, pages: PageManager) -> None:
        self.pages = pages
        self._held: dict[str, HeldKV] = {}
        self._reserved: dict[str, Reservation] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held or request_id in self._reserved

    def request_ids(self) -> set[str]:
        """Every request holding pages here (held for a transfer, or reserved for one)."""
        return set(self._held) | set(self._reserved)

    # -- prefill side -------------------------------------------------------------------------
    def hold(self, request_id: str, page_ids: Sequence[int], num_tokens: int) -> None:
        self._held[request_id] = HeldKV(tuple(page_ids), num_tokens)

    def held(self, request_id: str) -> HeldKV:
        if request_id not in self._held:
            raise ValueError(f"no KV is held for request {request_id!r}")
        return self._held[request_id]

    def release(self, request_id: str) -> None:
        """Frees held pages once the transfer has ended, whatever its outcome."""
        held = self.held(request_id)
        del self._held[request_id]
        self.pages.release(reversed(held.page_ids))

    # -- decode side --------------------------------------------------------------------------
    def reserve(self, request_id: str, prompt_token_ids: Sequence[int]) -> Reservation | None:
        """Pages for a prompt's KV, reusing cached leading pages; None when they do not fit now
        (backpressure: the caller retries later rather than prefilling into nowhere)."""
        if request_id in self:
            raise ValueError(f"request id {request_id!r} already holds pages here")
        page_size = self.pages.page_size
        num_tokens = len(prompt_token_ids)
        if -(-num_tokens // page_size) > self.pages.num_pages:
            raise ValueError(f"a prompt of {num_tokens} tokens needs more KV pages than this cache has "
                             f"({self.pages.num_pages} of {page_size} tokens)")
        hashes = hash_full_pages(list(prompt_token_ids), page_size)
        hits = self.pages.match_prefix(hashes)
        need = -(-num_tokens // page_size) - len(hits)
        if not self.pages.can_allocate(need + self.pages.num_evictable_among(hits)):
            return None
        self.pages.acquire(hits)
        self.pages.record_lookup(num_tokens, len(hits) * page_size)
        res = Reservation(tuple(hits + self.pages.allocate(need)), len(hits), num_tokens,
                          tuple(hashes[: len(hits)]))
        self._reserved[request_id] = res
        return res

    def reservation(self, request_id: str) -> Reservation:
        if request_id not in self._reserved:
            raise ValueError(f"no pages are reserved for request {request_id!r}")
        return self._reserved[request_id]

    def take(self, request_id: str) -> Reservation:
        """Hands a reservation's pages on to the sequence that will decode with them."""
        res = self.reservation(request_id)
        del self._reserved[request_id]
        return res

    def cancel(self, request_id: str) -> None:
        """Returns a reservation's pages (prefill failed, or its lease expired)."""
        self.pages.release(reversed(self.take(request_id).page_ids))

    def drop(self, request_id: str) -> bool:
        """Frees whatever this request holds here; False if nothing."""
        if request_id in self._held:
            self.release(request_id)
            return True
        if request_id in self._reserved:
            self.cancel(request_id)
            return True
        return False
