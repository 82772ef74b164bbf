"""Submitting at a fixed interval: the loop behind dashboard bursts and benchmark bursts."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator


def paced(count: int, interval_s: float, stop: threading.Event | None = None) -> Iterator[int]:
    """Yield 0..count-1, the i-th at start + i * interval_s (never early; a late one at once,
    so a slow submit does not shift the later ones). Ends early once `stop` is set."""
    stop = stop or threading.Event()
    start = time.monotonic()
    for i in range(count):
        if stop.wait(max(0.0, start + i * interval_s - time.monotonic())):
            return
        yield i
