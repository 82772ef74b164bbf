"""Each worker's recent history, one point a second for the last 15 minutes: prefill and
decode tok/s, running and waiting requests, KV usage. For the dashboard's history charts (the
worker panels' sparklines keep their own, shorter, 5 Hz history).

A point is the mean of the worker's stats reports (5 a second) that fell in that second. The
picture handed to snapshots is rebuilt only when a second closes, so a snapshot costs nothing
more between seconds.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

SERIES = ("prefill_tps", "decode_tps", "running", "waiting", "kv_usage")
KEEP_S = 15 * 60
WINDOWS_S = (60, 5 * 60, 15 * 60)


@dataclass(frozen=True)
class History:
    """One worker's points: their times (time.monotonic(), one a second) and each series' values
    (kv_usage 0..1, None where the worker reports none)."""
    times: tuple[float, ...] = ()
    series: dict | None = None       # name -> tuple of values, one per time

    def values(self, name: str) -> tuple:
        return (self.series or {}).get(name, ())


class HistoryStore:
    """Fed with every WorkerStats by the dispatcher; read by snapshot()."""

    def __init__(self, keep_s: int = KEEP_S) -> None:
        self._lock = threading.Lock()
        self._keep = keep_s
        self._points: dict[int, deque] = {}      # worker -> (second, values...) per closed second
        self._open: dict[int, tuple[int, list[list]]] = {}   # worker -> (second, reports so far)
        self._views: dict[int, History] = {}

    def add(self, worker: int, t: float, stats) -> None:
        pages = stats.pages_used / stats.pages_total if stats.pages_total else stats.kv_usage
        values = (stats.prefill_tps, stats.decode_tps, stats.running, stats.waiting, pages)
        second = int(t)
        with self._lock:
            current = self._open.get(worker)
            if current is not None and current[0] != second:
                self._close(worker, *current)
                current = None
            if current is None:
                current = self._open[worker] = (second, [])
            current[1].append(values)

    def _close(self, worker: int, second: int, reports: list) -> None:
        points = self._points.setdefault(worker, deque(maxlen=self._keep))
        point = [float(second)]
        for column in zip(*reports):
            known = [v for v in column if v is not None]
            point.append(sum(known) / len(known) if known else None)
        points.append(tuple(point))
        self._views.pop(worker, None)

    def histories(self) -> dict[int, History]:
        with self._lock:
            for worker, points in self._points.items():
                if worker not in self._views:
                    columns = list(zip(*points))
                    self._views[worker] = History(columns[0], dict(zip(SERIES, columns[1:])))
            return dict(self._views)
