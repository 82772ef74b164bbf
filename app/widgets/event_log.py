"""The event log: the engine's log lines (errors, preemptions, deaths, policy changes, burst
summaries), appended as they appear in snapshots.
"""
from __future__ import annotations

import time
from collections import deque

from rich.text import Text
from textual.widgets import RichLog

from app.flags import as_flags
from app.widgets.panel import PanelSpec
from engine.facade.snapshot import LogLine
from engine.outside import visible

LEVEL_COLOUR = {"error": "error", "warning": "warning", "info": "primary"}
LEVEL_LABEL = {"error": "ERROR", "warning": "WARN", "info": "INFO"}
MAX_LINES = 1000


def format_clock(timestamp: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(timestamp))



class EventLog(RichLog):
    def __init__(self, **kwargs) -> None:
        super().__init__(max_lines=MAX_LINES, min_width=20, wrap=True, markup=False, **kwargs)
        self._last: LogLine | None = None
        self._shown: deque[LogLine] = deque(maxlen=MAX_LINES)

    def on_mount(self) -> None:
        # RichLog keeps rendered lines: repaint them in the new theme's colours.
        self.app.theme_changed_signal.subscribe(self, lambda _: self.call_after_refresh(self._rewrite))

    def _rewrite(self) -> None:
        self.clear()
        for line in self._shown:
            self.write(self._format(line))

    def _format(self, line: LogLine) -> Text:
        colour = self.app.theme_variables[LEVEL_COLOUR.get(line.level, "foreground")]
        # a line quotes requests, files and servers; a replayed one is all outside text
        return Text.assemble((format_clock(line.time) + " ", "dim"),
                             (f"{visible(LEVEL_LABEL.get(line.level, line.level.upper())):<5} ", f"bold {colour}"),
                             visible(as_flags(line.text)))

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
        for line in lines[start:]:
            self._shown.append(line)
            self.write(self._format(line))
        self._last = lines[-1]


PANEL = PanelSpec(EventLog, id="log", box="log", row="bottom", title="log",
                  draw=lambda log, f: log.show_lines(f.snap.log))
