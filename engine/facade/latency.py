"""Latency percentiles over a window of time, from the facade's request records.

Four figures per request, each timed at the moment it became known (so a request's TTFT sits
in the same place whether it is still running or has finished):

  queue   arrival -> first scheduled
  ttft    arrival -> first token
  itl     the request's mean gap between tokens (one sample per request with two tokens or
          more: what vLLM's benchmarks call TPOT)
  e2e     arrival -> finish, for requests that stopped or reached their length (an abort or
          an error says nothing about how fast the engine is)

A finished request contributes the figures its worker measured (RequestMetrics); a live one the
figures the facade has seen so far (its queue time once scheduled, its TTFT once it has a token,
its ITL so far). Windows: the last 10 s, the last 60 s, or the session (since the engine
started, the latest SESSION_SAMPLES of each series). Percentiles are nearest-rank, as
engine/stats.py computes them: every figure shown is one a request really had.
"""
from __future__ import annotations

import bisect
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

METRICS = ("ttft", "itl", "e2e", "queue")
WINDOWS = (("10s", 10.0), ("60s", 60.0), ("session", None))
QUANTILES = (50, 95, 99)
RECENT_S = max(s for _, s in WINDOWS if s is not None)   # finished samples kept in time order
SESSION_SAMPLES = 100_000     # per series; the oldest go first
# Histogram bins: ten a decade from 0.1 ms to 1000 s; values outside land in the end bins.
HIST_EDGES = tuple(10 ** (k / 10) for k in range(-40, 31))
HIST_BINS = len(HIST_EDGES) - 1
E2E_REASONS = ("stop", "length")


@dataclass(frozen=True)
class Summary:
    """One metric over one window: how many samples, and their 50th, 95th and 99th percentiles (s)."""
    count: int = 0
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    hist: tuple[int, ...] = ()    # samples per HIST_EDGES bin (the all-workers series only)

    def to_json(self) -> dict:
        return {"count": self.count, "p50": self.p50, "p95": self.p95, "p99": self.p99}


@dataclass(frozen=True)
class LatencyView:
    """Every metric over one window, for all workers together and for each worker."""
    window: str                                   # 10s | 60s | session
    seconds: float | None                         # None: the whole session
    overall: dict[str, Summary] = field(default_factory=dict)        # metric -> summary
    workers: dict[int, dict[str, Summary]] = field(default_factory=dict)

    def summary(self, metric: str, worker: int | None = None) -> Summary:
        table = self.overall if worker is None else self.workers.get(worker, {})
        return table.get(metric, Summary())

    def to_json(self) -> dict:
        return {"window": self.window, "seconds": self.seconds,
                "overall": {m: s.to_json() for m, s in self.overall.items()},
                "workers": {str(w): {m: s.to_json() for m, s in t.items()} for w, t in self.workers.items()}}


def rank(n: int, q: float) -> int:
    """Nearest rank (1-based) of the q-th percentile among n samples (engine/stats.py's)."""
    return int(max(1, -(-n * q // 100)))


def kth_of_union(a: list[float], b: list[float], k: int) -> float:
    """The k-th smallest (1-based) of two sorted lists together, without merging them: the
    session series is long, the live samples few."""
    lo, hi = max(0, k - len(a)), min(k, len(b))
    while lo < hi:               # j = how many of the k come from b
        j = (lo + hi) // 2
        if k - j > 0 and b[j] < a[k - j - 1]:
            lo = j + 1
        else:
            hi = j
    i, j = k - lo, lo
    return max(a[i - 1] if i else float("-inf"), b[j - 1] if j else float("-inf"))


_INNER_EDGES = np.array(HIST_EDGES[1:-1])


def histogram(sorted_parts: Iterable) -> tuple[int, ...]:
    """Counts per HIST_EDGES bin of the values in sorted lists or arrays (outliers in the end bins)."""
    counts = np.zeros(HIST_BINS, dtype=np.int64)
    for values in sorted_parts:
        if len(values):
            below = np.searchsorted(values, _INNER_EDGES, side="left") if isinstance(values, np.ndarray) \
                else np.array([bisect.bisect_left(values, e) for e in HIST_EDGES[1:-1]])
            counts += np.diff(below, prepend=0, append=len(values))
    return tuple(counts.tolist())


def summarise(a, b=(), hist: bool = False) -> Summary:
    """The summary of the sorted lists (or arrays) a and b taken together."""
    n = len(a) + len(b)
    if not n:
        return Summary(hist=(0,) * HIST_BINS if hist else ())
    if isinstance(a, np.ndarray):      # a window: small enough to merge
        merged = np.sort(np.concatenate((a, np.asarray(b, dtype=float)))) if len(b) else a
        p = [float(merged[rank(n, q) - 1]) for q in QUANTILES]
        return Summary(n, *p, hist=histogram((merged,)) if hist else ())
    b = list(b)
    p = [kth_of_union(a, b, rank(n, q)) for q in QUANTILES]
    return Summary(n, *p, hist=histogram((a, b)) if hist else ())


class _Series:
    """One metric of one worker (or of all): the last RECENT_S seconds of samples as arrays in
    time order, and the session's values sorted, with their arrival order to drop the oldest
    past SESSION_SAMPLES."""

    def __init__(self) -> None:
        self.times = np.empty(0)
        self.values = np.empty(0)
        self.pending: list[tuple[float, float]] = []
        self.sorted: list[float] = []
        self.order: deque[float] = deque()

    def add(self, t: float, value: float) -> None:
        self.pending.append((t, value))
        bisect.insort(self.sorted, value)
        self.order.append(value)
        if len(self.order) > SESSION_SAMPLES:
            old = self.order.popleft()
            del self.sorted[bisect.bisect_left(self.sorted, old)]

    def prune(self, now: float) -> None:
        """Take in what was added since, in time order (samples arrive when their request
        finishes, timed when they happened), and drop what is older than RECENT_S."""
        if self.pending:
            t, v = np.array(self.pending).T
            self.pending.clear()
            times, values = np.concatenate((self.times, t)), np.concatenate((self.values, v))
            order = np.argsort(times, kind="stable")
            self.times, self.values = times[order], values[order]
        cut = int(np.searchsorted(self.times, now - RECENT_S, side="left"))
        if cut:
            self.times, self.values = self.times[cut:], self.values[cut:]

    def since(self, start: float) -> np.ndarray:
        return np.sort(self.values[np.searchsorted(self.times, start, side="left"):])


Sample = tuple[str, int | None, float, float]   # (metric, worker, time, value)


def finished_samples(rec) -> list[Sample]:
    """The figures of a finished request (a RequestRecord), timed when each happened."""
    m, worker, t0 = rec.metrics, rec.worker, rec.arrival
    out: list[Sample] = []
    if m is None:
        return out
    if m.queue_time is not None:
        out.append(("queue", worker, t0 + m.queue_time, m.queue_time))
    if m.ttft is not None:
        out.append(("ttft", worker, t0 + m.ttft, m.ttft))
    end = rec.finished_at if rec.finished_at is not None else t0 + m.e2e
    if m.itl_mean is not None:
        out.append(("itl", worker, end, m.itl_mean))
    if rec.finish_reason in E2E_REASONS:
        out.append(("e2e", worker, end, m.e2e))
    return out


def live_samples(rec, now: float) -> list[Sample]:
    """What a request still running has shown so far: queue time, TTFT, ITL up to now."""
    out: list[Sample] = []
    worker, t0 = rec.worker, rec.arrival
    if rec.prefill_at is not None:
        out.append(("queue", worker, rec.prefill_at, rec.prefill_at - t0))
    if rec.first_token_at is not None:
        out.append(("ttft", worker, rec.first_token_at, rec.first_token_at - t0))
        n = len(rec.output_ids)
        if n > 1 and rec.last_token_at is not None:
            out.append(("itl", worker, now, (rec.last_token_at - rec.first_token_at) / (n - 1)))
    return out


class LatencyWindow:
    """Every finished request's figures, and the percentiles of each window on request.

    `add_finished` runs on the dispatcher thread, `views` wherever a snapshot is taken: the
    window has its own lock, so the facade's lock is not held while percentiles are worked out.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._series: dict[tuple[str, int | None], _Series] = {}

    def add(self, samples: Iterable[Sample]) -> None:
        with self._lock:
            for metric, worker, t, value in samples:
                for key in ((metric, None), (metric, worker)):
                    series = self._series.get(key)
                    if series is None:
                        series = self._series[key] = _Series()
                    series.add(t, value)

    def add_finished(self, rec) -> None:
        self.add(finished_samples(rec))

    def views(self, now: float, live: Iterable[Sample] = ()) -> dict[str, LatencyView]:
        """window name -> LatencyView at `now`, finished samples plus the live ones given."""
        extra: dict[tuple[str, int | None], list[tuple[float, float]]] = {}
        for metric, worker, t, value in live:
            extra.setdefault((metric, None), []).append((t, value))
            extra.setdefault((metric, worker), []).append((t, value))
        # sorted by value once: each window keeps the ones in it, still in order
        extra = {key: sorted(pairs, key=lambda p: p[1]) for key, pairs in extra.items()}
        with self._lock:
            for series in self._series.values():
                series.prune(now)
            keys = set(self._series) | set(extra)
            workers = sorted({w for _, w in keys if w is not None})
            out = {}
            for name, seconds in WINDOWS:
                start = now - seconds if seconds is not None else float("-inf")
                table: dict[int | None, dict[str, Summary]] = {}
                for metric in METRICS:
                    for worker in [None, *workers]:
                        series = self._series.get((metric, worker))
                        more = [v for t, v in extra.get((metric, worker), ()) if t >= start]
                        if series is None:
                            base = [] if seconds is None else np.empty(0)
                        else:
                            base = series.sorted if seconds is None else series.since(start)
                        table.setdefault(worker, {})[metric] = summarise(base, more, hist=worker is None)
                out[name] = LatencyView(name, seconds, table.pop(None),
                                        {w: t for w, t in table.items()})
            return out


def live_samples_of(records: Iterable, now: float) -> list[Sample]:
    """live_samples of every record whose request has not finished."""
    out: list[Sample] = []
    for rec in records:
        if rec.finish_reason is None:
            out += live_samples(rec, now)
    return out
