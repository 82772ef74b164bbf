"""A worker's step counts and its prefill / decode rates over the last RATE_WINDOW seconds, as
its WorkerStats report them."""
from __future__ import annotations

import time
from collections import deque

RATE_WINDOW = 2.0        # seconds of history behind the prefill / decode tok/s shown


class StepCounts:
    def __init__(self):
        self.steps = 0
        self.last_step_tokens = 0
        self.prefill_total = 0
        self.decode_total = 0
        self._history: deque[tuple[float, int, int]] = deque()   # (when, prefill, decode tokens)

    def add(self, now: float, prefill: int, decode: int, total: int) -> None:
        """One step: its prefill and decode tokens, of `total` in all."""
        self.steps += 1
        self.last_step_tokens = total
        self.prefill_total += prefill
        self.decode_total += decode
        self._history.append((now, prefill, decode))
        while self._history and now - self._history[0][0] > RATE_WINDOW:
            self._history.popleft()

    def rates(self) -> tuple[float, float]:
        """Prefill and decode tokens per second lately; zero once idle for RATE_WINDOW."""
        if not self._history:
            return 0.0, 0.0
        now = time.monotonic()
        span = max(now - self._history[0][0], 0.25)
        if now - self._history[-1][0] > RATE_WINDOW:
            return 0.0, 0.0
        return (sum(h[1] for h in self._history) / span, sum(h[2] for h in self._history) / span)
