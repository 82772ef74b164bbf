"""CPU% and resident memory of a worker, read from /proc (Linux); None elsewhere.

A process-mode worker is measured as its whole process; a thread-mode worker as its own
thread's CPU time (its memory is the host process's, so no RSS is given for it). CPU% is
the CPU time used between two readings at least MIN_INTERVAL_S apart, over that wall time:
100% is one core busy.
"""
from __future__ import annotations

import os
import time

MIN_INTERVAL_S = 0.5
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def cpu_seconds(stat_path: str) -> float | None:
    """utime + stime from a /proc/.../stat file, in seconds."""
    try:
        with open(stat_path, "rb") as f:
            text = f.read().decode()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()   # the command name may contain spaces
    return (int(fields[11]) + int(fields[12])) / _TICKS


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class UsageSampler:
    """Remembers the previous reading per key, so each call can turn CPU time into CPU%."""

    def __init__(self) -> None:
        self._last: dict[object, tuple[float, float, float | None]] = {}  # key -> (wall, cpu, percent)

    def sample(self, key: object, pid: int | None, thread_id: int | None = None
               ) -> tuple[float | None, int | None]:
        """(CPU %, RSS bytes) of process `pid`, or of thread `thread_id` of this process."""
        if thread_id is not None:
            cpu, rss = cpu_seconds(f"/proc/self/task/{thread_id}/stat"), None
        elif pid is not None:
            cpu, rss = cpu_seconds(f"/proc/{pid}/stat"), rss_bytes(pid)
        else:
            return None, None
        if cpu is None:
            self._last.pop(key, None)
            return None, rss
        now = time.monotonic()
        last = self._last.get(key)
        if last is None:
            self._last[key] = (now, cpu, None)
            return None, rss
        wall, before, percent = last
        if now - wall >= MIN_INTERVAL_S:
            percent = max(0.0, 100.0 * (cpu - before) / (now - wall))
            self._last[key] = (now, cpu, percent)
        return percent, rss
