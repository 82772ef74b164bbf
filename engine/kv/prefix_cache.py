"""Automatic prefix caching: full KV pages keyed by a hash chain, shared by refcount.

A full page's key is sha256(parent key, extra key, the page's token ids): the key of page i
names the whole prefix up to the end of page i, so equal keys mean equal prefixes. The
extra key is the model's identity plus the request's optional `cache_salt`: requests with
different salts never share a page (tenant isolation; no timing side channel).

Ownership: a page belongs to the sequences holding it (PagePool refcount). Publishing a
page records its key here and marks it `keep` in the pool; when its last holder releases
it the page stays *cached* (refcount 0, K/V intact) until allocation evicts it, least
recently released first. Only a hit on a chain from its head can reach a page, so a
sequence's pages are released tail first: its tail is evicted before its head.

Correctness never rests on the hash: a hit compares the page's stored (parent key, extra
key, token ids) with the request's, and a sequence whose key is already taken by different
content stops publishing its chain (its later keys would name the wrong prefix).
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence as Seq

if TYPE_CHECKING:   # the facade hashes page keys with this module: it must not import torch
    from engine.kv.pages import PagePool
    from engine.kv.paged import PagedSequence

ROOT = bytes(32)          # parent key of a sequence's first page
DELTA_KEY_BYTES = 8       # key prefix sent to the facade for routing estimates


def extra_key(model_identity: str, cache_salt: str | None) -> bytes:
    """What besides tokens decides a page's K/V (model, weights, dtype) and who may share it."""
    salt = "" if cache_salt is None else "\x01" + cache_salt
    return hashlib.sha256(f"tokentop-kv\0{model_identity}\0{salt}".encode()).digest()


def page_key(parent: bytes, tokens: Seq[int], extra: bytes) -> bytes:
    return hashlib.sha256(parent + extra + array("q", tokens).tobytes()).digest()


def chain_keys(tokens: Seq[int], page_size: int, extra: bytes, max_pages: int | None = None,
               key_fn: Callable = page_key) -> list[bytes]:
    """Keys of the full pages of `tokens` (at most max_pages of them), head first."""
    n = len(tokens) // page_size
    if max_pages is not None:
        n = min(n, max_pages)
    keys, parent = [], ROOT
    for i in range(n):
        parent = key_fn(parent, tokens[i * page_size:(i + 1) * page_size], extra)
        keys.append(parent)
    return keys


def model_identity(model: str, activation_dtype: str, simulated: bool = False) -> str:
    return f"{model}|{activation_dtype}" + ("|sim" if simulated else "")


@dataclass(frozen=True)
class _Entry:
    key: bytes
    parent: bytes
    extra: bytes
    tokens: tuple[int, ...]


class PrefixCache:
    def __init__(self, pool: PagePool, model_identity: str, key_fn: Callable = page_key,
                 on_event: Callable[[str, dict], None] | None = None):
        self.pool = pool
        self.page_size = pool.page_size
        self.model_identity = model_identity
        self.key_fn = key_fn              # tests inject a colliding hash
        self.on_event = on_event          # trace instants: publish / evict
        self._by_key: dict[bytes, int] = {}
        self._entry: dict[int, _Entry] = {}
        pool.on_evict = self._evicted
        # counters (names map onto vLLM's prefix_cache_queries / prefix_cache_hits, in tokens)
        self.queries = 0
        self.hits = 0
        self.published = 0
        self.evictions = 0
        self.collisions = 0
        self._delta: list[tuple[bool, bytes]] = []   # (added?, key prefix), in order
        # (key prefix, parent's key prefix or None at a chain's head, the page's tokens) per
        # published page, (key prefix, None, None) per evicted one: KV events for routers
        self._blocks: list[tuple[bytes, bytes | None, tuple[int, ...] | None]] = []

    # --- keys -------------------------------------------------------------------------
    def extra_of(self, seq: PagedSequence) -> bytes:
        if not seq.cache_extra:
            seq.cache_extra = extra_key(self.model_identity, seq.params.cache_salt)
        return seq.cache_extra

    def keys(self, seq: PagedSequence, n_pages: int) -> list[bytes]:
        """The first n_pages keys of seq's chain (extends the memo; tokens only grow)."""
        ps, keys = self.page_size, seq.page_keys
        n_pages = min(n_pages, seq.num_tokens // ps)
        if len(keys) < n_pages:
            extra = self.extra_of(seq)
            parent = keys[-1] if keys else ROOT
            for i in range(len(keys), n_pages):
                parent = self.key_fn(parent, [seq.token_at(j) for j in range(i * ps, (i + 1) * ps)], extra)
                keys.append(parent)
        return keys[:n_pages]

    # --- lookup -----------------------------------------------------------------------
    def match(self, seq: PagedSequence, max_tokens: int) -> list[int]:
        """Cached pages holding seq's longest prefix of at most max_tokens tokens (not retained)."""
        ps, extra = self.page_size, self.extra_of(seq)
        pages: list[int] = []
        parent = ROOT
        for i, key in enumerate(self.keys(seq, max_tokens // ps)):
            page = self._by_key.get(key)
            if page is None:
                break
            e = self._entry[page]
            tokens = tuple(seq.token_at(j) for j in range(i * ps, (i + 1) * ps))
            if e.parent != parent or e.extra != extra or e.tokens != tokens:
                self.collisions += 1       # same key, other content: a miss, never a wrong hit
                break
            pages.append(page)
            parent = key
        return pages

    def count_lookup(self, looked_up: int, hit: int) -> None:
        self.queries += looked_up
        self.hits += hit

    def contains(self, page: int) -> bool:
        return page in self._entry

    # --- publication ------------------------------------------------------------------
    def publish(self, seq: PagedSequence, prompt_only: bool = False) -> list[bytes]:
        """Key every newly completed page of seq's computed tokens; returns the new keys.

        prompt_only: publish prompt pages only (deterministic mode: a decode step computes
        K/V one row at a time, a prefill chunk 64 rows at a time, not bit-identically)."""
        ps = self.page_size
        # positions with known tokens only: right after a speculative verify step
        # num_computed also counts draft positions that may yet be rolled back
        upto = min(min(seq.num_computed, seq.num_tokens) // ps, len(seq.block_table))
        if prompt_only:
            upto = min(upto, len(seq.prompt_ids) // ps)
        if seq.publish_limit is not None:
            upto = min(upto, seq.publish_limit)
        if upto <= seq.num_published:
            return []
        keys = self.keys(seq, upto)
        extra = self.extra_of(seq)
        new = []
        for i in range(seq.num_published, upto):
            page, key = seq.block_table[i], keys[i]
            if page in self._entry:            # restored from the cache: already published
                continue
            tokens = tuple(seq.token_at(j) for j in range(i * ps, (i + 1) * ps))
            entry = _Entry(key, keys[i - 1] if i else ROOT, extra, tokens)
            other = self._by_key.get(key)
            if other is not None:
                if self._entry[other] != entry:
                    self.collisions += 1       # our later keys would name a different prefix
                    seq.publish_limit = i
                    upto = i
                    break
                continue                       # computed twice (no single flight): keep the first
            self._by_key[key] = page
            self._entry[page] = entry
            self.pool.keep(page)
            self.published += 1
            self._delta.append((True, key[:DELTA_KEY_BYTES]))
            self._blocks.append((key[:DELTA_KEY_BYTES], entry.parent[:DELTA_KEY_BYTES] if i else None, tokens))
            new.append(key)
        seq.num_published = upto
        if new and self.on_event:
            self.on_event("publish", {"request": seq.id, "pages": len(new)})
        return new

    def _evicted(self, page: int) -> None:
        e = self._entry.pop(page)
        del self._by_key[e.key]
        self.evictions += 1
        self._delta.append((False, e.key[:DELTA_KEY_BYTES]))
        self._blocks.append((e.key[:DELTA_KEY_BYTES], None, None))
        if self.on_event:
            self.on_event("evict", {"page": page})

    # --- reporting --------------------------------------------------------------------
    @property
    def num_keys(self) -> int:
        return len(self._by_key)

    def take_delta(self) -> tuple[tuple[bool, bytes], ...]:
        """(added?, key prefix) since the last call, in order: the facade's routing view."""
        delta = tuple(self._delta)
        self._delta.clear()
        return delta

    def take_blocks(self) -> tuple[tuple[bytes, bytes | None, tuple[int, ...] | None], ...]:
        """Pages published (key, parent key, tokens) and evicted (key, None, None) since the
        last call, in order: what vLLM-format KV events are made of (engine/serve/kv_events.py)."""
        blocks = tuple(self._blocks)
        self._blocks.clear()
        return blocks
