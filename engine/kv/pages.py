"""Page pool with reference counts, and block-table management per sequence.

A page holds `page_size` consecutive token positions of one sequence (K and V for every
layer). Pages are refcounted so the prefix cache can share them. When its last holder
releases it, a page either returns to the free list or, if the prefix cache has keyed it
(`keep`), stays *cached*: refcount 0, its K/V intact and findable, reusable until
allocation needs the memory and evicts it (least recently released first).
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from typing import Callable

import torch

from engine.kv.residency import PageResidency
from engine.kv.states import CACHED, FREE, SHARED, USED
from engine.kv.paged import PagedSequence


class OutOfPages(Exception):
    """Raised by allocate() when the pool is empty; the scheduler preempts and retries."""


class PagePool:
    def __init__(self, num_pages: int, page_size: int, clock: Callable[[], float] = time.monotonic):
        if num_pages < 1:
            raise ValueError("a KV page pool needs at least one page")
        self.num_pages = num_pages
        self.page_size = page_size
        self.refcount = [0] * num_pages
        self._states = bytearray(num_pages)      # kept in step with refcount for the dashboard
        self._free: deque[int] = deque(range(num_pages))
        # refcount-0 pages the prefix cache keeps findable, least recently released first
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._keep = bytearray(num_pages)
        self.on_evict: Callable[[int], None] | None = None   # the prefix cache forgets the key
        self.residency = PageResidency(num_pages, clock)     # vLLM's KV residency histograms

    @property
    def num_free(self) -> int:
        """Pages an allocation can take: truly free plus cached (evictable) ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        """Pages some sequence holds (refcount >= 1)."""
        return self.num_pages - len(self._free) - len(self._cached)

    def allocate(self) -> int:
        if self._free:
            page = self._free.popleft()
        elif self._cached:
            page, _ = self._cached.popitem(last=False)   # LRU eviction
            self._keep[page] = 0
            self.residency.evicted(page)
            if self.on_evict is not None:
                self.on_evict(page)
        else:
            raise OutOfPages
        self._set(page, 1)
        self.residency.allocated(page)
        return page

    def keep(self, page: int) -> None:
        """Mark a held page as keyed by the prefix cache: it will be cached, not freed."""
        if self.refcount[page] <= 0:
            raise RuntimeError(f"keep of unheld page {page}")
        self._keep[page] = 1

    def is_cached(self, page: int) -> bool:
        return page in self._cached

    def _set(self, page: int, count: int) -> None:
        self.refcount[page] = count
        if count == 0:
            self._states[page] = CACHED if self._keep[page] else FREE
        else:
            self._states[page] = USED if count == 1 else SHARED

    def take(self, page: int) -> None:
        """Allocate one specific free page (contiguous regions need a fixed run of pages)."""
        self._free.remove(page)
        self._set(page, 1)
        self.residency.allocated(page)

    def retain(self, page: int) -> None:
        """Add a holder; a cached page (refcount 0) comes back into use with its K/V."""
        if self.refcount[page] <= 0:
            if page not in self._cached:
                raise RuntimeError(f"retain of free page {page}")
            del self._cached[page]
        self._set(page, self.refcount[page] + 1)
        self.residency.reused(page)

    def release(self, page: int) -> None:
        if self.refcount[page] <= 0:
            raise RuntimeError(f"page {page} released more often than retained")
        self._set(page, self.refcount[page] - 1)
        if self.refcount[page] == 0:
            if self._keep[page]:
                self._cached[page] = None      # most recently released: evicted last
                self.residency.released(page)
            else:
                self._free.append(page)
                self.residency.freed(page)

    def states(self) -> bytes:
        return bytes(self._states)


class BlockManager:
    """Grows and frees block tables; turns (sequence, positions) into KV slot indices.

    paged: any free page can hold the next positions of any sequence; attention gathers
    a sequence's slots through its block table.
    contiguous (benchmark baseline): each admitted sequence owns one fixed region of
    `region_pages` consecutive pages, so its slots are a plain range and attention reads a view.
    """

    def __init__(self, pool: PagePool, mode: str = "paged", region_pages: int = 0):
        self.pool = pool
        self.mode = mode
        self.page_size = pool.page_size
        if mode == "contiguous":
            if region_pages < 1:
                raise ValueError("contiguous mode needs region_pages >= 1")
            self.region_pages = region_pages
            self._free_regions = deque(range(pool.num_pages // region_pages))
            self._region_of: dict[str, int] = {}

    def pages_needed(self, seq: PagedSequence, upto_tokens: int) -> int:
        have = len(seq.block_table)
        need = -(-upto_tokens // self.page_size)
        if self.mode == "contiguous":
            return 0 if seq.id in self._region_of else self.region_pages
        return max(0, need - have)

    def can_grow(self, seq: PagedSequence, upto_tokens: int) -> bool:
        if self.mode == "contiguous":
            if seq.id in self._region_of:
                return upto_tokens <= self.region_pages * self.page_size
            return bool(self._free_regions) and upto_tokens <= self.region_pages * self.page_size
        return self.pages_needed(seq, upto_tokens) <= self.pool.num_free

    def grow(self, seq: PagedSequence, upto_tokens: int) -> None:
        """Make seq's block table cover positions [0, upto_tokens). Raises OutOfPages."""
        if self.mode == "contiguous":
            if seq.id not in self._region_of:
                if not self._free_regions:
                    raise OutOfPages
                region = self._free_regions.popleft()
                self._region_of[seq.id] = region
                first = region * self.region_pages
                for p in range(first, first + self.region_pages):
                    self.pool.take(p)
                seq.block_table = list(range(first, first + self.region_pages))
            if upto_tokens > self.region_pages * self.page_size:
                raise OutOfPages
            return
        need = self.pages_needed(seq, upto_tokens)
        if need > self.pool.num_free:
            raise OutOfPages
        for _ in range(need):
            seq.block_table.append(self.pool.allocate())

    def free(self, seq: PagedSequence) -> None:
        for page in reversed(seq.block_table):
            self.pool.release(page)
        seq.block_table = []
        self.truncate_draft(seq, 0)
        if self.mode == "contiguous":
            region = self._region_of.pop(seq.id, None)
            if region is not None:
                self._free_regions.append(region)

    def truncate(self, seq: PagedSequence, upto_tokens: int) -> None:
        """Keep the pages holding positions [0, upto_tokens), release whole pages past them.

        Speculative decoding rolls rejected draft positions back this way. Slots past
        upto_tokens inside the last kept page hold stale K/V, but a position is always
        written in the step that first attends to it, so nothing stale is ever read.
        """
        if self.mode == "contiguous":
            return
        keep = -(-upto_tokens // self.page_size)
        while len(seq.block_table) > keep:
            self.pool.release(seq.block_table.pop())

    # The draft model of speculative decoding keeps its own block table over the same pool
    # (its K/V live in a second store indexed by the same slots); paged mode only.
    def grow_draft(self, seq: PagedSequence, upto_tokens: int) -> bool:
        """Cover draft positions [0, upto_tokens); False (nothing taken) when pages are short."""
        need = max(0, -(-upto_tokens // self.page_size) - len(seq.draft_table))
        if self.mode == "contiguous" or need > self.pool.num_free:
            return False
        for _ in range(need):
            seq.draft_table.append(self.pool.allocate())
        return True

    def truncate_draft(self, seq: PagedSequence, upto_tokens: int) -> None:
        keep = -(-upto_tokens // self.page_size)
        while len(seq.draft_table) > keep:
            self.pool.release(seq.draft_table.pop())
        seq.draft_computed = min(seq.draft_computed, upto_tokens)

    def slots(self, seq: PagedSequence, start: int, end: int, *, draft: bool = False) -> torch.Tensor:
        """KV slot of each position in [start, end) of seq (of its draft model's table).

        A view of a per-sequence tensor of every slot its pages hold, rebuilt only when the
        table changes: built afresh each step (three tensor ops a sequence), 8 sequences of 100
        tokens took 0.088 ms a step, now 0.008. Callers must not write into the result."""
        table = seq.draft_table if draft else seq.block_table
        cached = seq.slot_cache.get(draft)
        if cached is None or cached[0] != table:
            ps = self.page_size
            pages = torch.tensor(table, dtype=torch.int64)
            cached = (list(table), (pages[:, None] * ps + torch.arange(ps)).reshape(-1))
            seq.slot_cache[draft] = cached
        if end > cached[1].numel():
            raise IndexError(f"positions up to {end} but the table holds {cached[1].numel()} slots")
        return cached[1][start:end]

    def contiguous_start(self, seq: PagedSequence) -> int | None:
        if self.mode != "contiguous":
            return None
        return seq.block_table[0] * self.page_size
