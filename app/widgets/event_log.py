"""The event log: the engine's log lines (errors, preemptions, deaths, policy changes, burst
summaries), appended as they appear in snapshots.
"""
from __future__ import annotations

import time

from rich.text import Text
from textual.widgets import RichLog

from engine.snapshot import LogLine

LEVEL_COLOUR = {"error": "error", "warning": "warning", "info": "primary"}
LEVEL_LABEL = {"error": "ERROR", "warning": "WARN", "info": "INFO"}


def format_clock(timestamp: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(timestamp))


class EventLog(RichLog):
    def __init__(self, **kwargs) -> None:
        super().__init__(max_lines=1000, min_width=20, wrap=True, markup=False, **kwargs)
        self._last: LogLine | None = None

    def show_lines(self, lines: tuple[LogLine, ...]) -> None:
        """Append the lines after the last one already shown (the engine keeps a bounded deque)."""
        if not lines or lines[-1] == self._last:
            return
        start = 0
        if self._last is not None:
            for i in range(len(lines) - 1, -1, -1):
                if lines[i] == self._last:
                    start = i + 1
                    break
            else:   # fell out of the engine's window: show what is newer than it
                start = next((i for i, l in enumerate(lines) if l.time > self._last.time), len(lines))
        colours = self.app.theme_variables
        for line in lines[start:]:
            level = LEVEL_LABEL.get(line.level, line.level.upper())
            text = Text.assemble((format_clock(line.time) + " ", "dim"),
                                 (f"{level:<5} ", f"bold {colours[LEVEL_COLOUR.get(line.level, 'foreground')]}"),
                                 line.text)
            self.write(text)
        self._last = lines[-1]
