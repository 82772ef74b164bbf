"""The engine's log: the lines the dashboard shows, with repeats grouped on one line."""
from __future__ import annotations

import threading
import time
from collections import deque

from engine.facade.snapshot import LogLine

LOG_LINES = 200          # lines kept
LOG_GROUP_WINDOW = 5.0   # seconds: the same event again within this is counted on one log line


class EventLog:
    def __init__(self, maxlen: int = LOG_LINES):
        self._lines: deque[LogLine] = deque(maxlen=maxlen)
        self._groups: dict[tuple, tuple[float, int, LogLine]] = {}   # key -> first, count, line
        self._lock = threading.Lock()

    def add(self, level: str, text: str) -> None:
        with self._lock:
            self._lines.append(LogLine(time.time(), level, text))

    def repeated(self, key: tuple, level: str, text: str) -> None:
        """Log an event that can repeat: within LOG_GROUP_WINDOW of its first line, a repeat
        rewrites that line as "... ×12 in 4.1 s" (moved to the end) instead of adding one.
        `text` has a {times} slot for that count."""
        now = time.time()
        with self._lock:
            for k in [k for k, g in self._groups.items() if now - g[0] >= LOG_GROUP_WINDOW]:
                del self._groups[k]
            first, count, old = self._groups.get(key, (now, 0, None))
            count += 1
            if old is not None and old in self._lines:
                self._lines.remove(old)
            times = f" ×{count} in {now - first:.1f} s" if count > 1 else ""
            line = LogLine(now, level, text.format(times=times))
            self._lines.append(line)
            self._groups[key] = (first, count, line)

    def lines(self) -> tuple[LogLine, ...]:
        with self._lock:
            return tuple(self._lines)
