"""KV page residency, measured from the page pool's own events (vLLM's three KV histograms).

  lifetime           a page's allocation -> its return to the free list, or its eviction
                     from the prefix cache (vllm:kv_block_lifetime_seconds)
  idle_before_evict  a cached page's last release -> its eviction
                     (vllm:kv_block_idle_before_evict_seconds)
  reuse_gap          the time between two uses of a page: its allocation or a prefix-cache hit,
                     then the next hit (vllm:kv_block_reuse_gap_seconds)

vLLM samples 1% of its blocks and keeps each block's last four accesses; the pool sees every
event, so every page and every gap is counted. The worker aggregates: each histogram is a
count per bucket plus a sum, a few hundred bytes shipped with its stats however busy it is.
"""
from __future__ import annotations

import time
from bisect import bisect_left
from typing import Callable

# vLLM's kv_cache_residency_buckets (vllm/v1/metrics/loggers.py), seconds
RESIDENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0,
                     30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0)
HISTOGRAMS = ("lifetime", "idle_before_evict", "reuse_gap")


class BucketCounts:
    """Observations per bucket (the last one past the largest bound) and their sum."""

    __slots__ = ("counts", "total")

    def __init__(self):
        self.counts = [0] * (len(RESIDENCY_BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(RESIDENCY_BUCKETS, seconds)] += 1     # le: bound >= value
        self.total += seconds


class PageResidency:
    """Per-page times of the pool's events, folded into three bucket counts as they happen."""

    def __init__(self, num_pages: int, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.born = [0.0] * num_pages       # when the page was allocated
        self.used = [0.0] * num_pages       # its last use (allocation or prefix-cache hit)
        self.idle = [0.0] * num_pages       # when its last holder released it
        self.hist = {name: BucketCounts() for name in HISTOGRAMS}

    def allocated(self, page: int) -> None:
        self.born[page] = self.used[page] = self.clock()

    def reused(self, page: int) -> None:
        """A prefix-cache hit took the page (cached, or held by another sequence)."""
        now = self.clock()
        self.hist["reuse_gap"].observe(now - self.used[page])
        self.used[page] = now

    def released(self, page: int) -> None:
        """Its last holder let it go: the page is cached (idle) from now on."""
        self.idle[page] = self.clock()

    def freed(self, page: int) -> None:
        """Its last holder let it go and nothing keys it: its life ends."""
        self.hist["lifetime"].observe(self.clock() - self.born[page])

    def evicted(self, page: int) -> None:
        """Allocation took the cached page for new contents."""
        now = self.clock()
        self.hist["lifetime"].observe(now - self.born[page])
        self.hist["idle_before_evict"].observe(now - self.idle[page])

    def as_dict(self) -> dict:
        """{name: (counts per bucket, sum)}: what WorkerStats carries to the facade."""
        return {name: (tuple(h.counts), h.total) for name, h in self.hist.items()}
