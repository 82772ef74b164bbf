"""Latency percentiles: p50 / p95 / p99 and the sample count of queue time, TTFT, ITL and e2e
over the window `w` chooses (10 s, 60 s, the session), a histogram per metric, and each
worker's p99 below when the panel has the room.

The figures are the engine's (EngineSnapshot.latency, engine/facade/latency.py), worked out
from its request records, not from what the dashboard happened to sample. A histogram's columns
are the engine's log-spaced bins, ten per decade (each column ×1.26 the one before), over the
range that metric's samples span, so a wide spread looks wide; its ends are labelled.
"""
from __future__ import annotations

from textual.containers import VerticalScroll
from textual.widgets import Static

from app.widgets.fmt import fit_parts, fmt_seconds, outside_markup, short_worker
from app.widgets.panel import PanelSpec
from engine.facade.latency import HIST_EDGES, METRICS, LatencyView, Summary

LABELS = {"ttft": "TTFT", "itl": "ITL", "e2e": "e2e", "queue": "queue"}
BARS = " ▁▂▃▄▅▆▇█"
MIN_SPAN = 10        # bins a histogram shows at least (one decade): narrow spreads stay narrow
HIST_MIN_WIDTH = 6   # columns below which the histogram is left out
ENDS_WIDTH = 14      # " 1.2ms–12.3s": the histogram's range, where there is room for it
TABLE_WIDTH = 34     # "queue   12.3s  12.3s  12.3s  12345": narrower, p95 is left out


def hist_bars(hist: tuple[int, ...], width: int) -> tuple[str, int, int]:
    """(bars, first bin, last bin) of a histogram over the bins its samples span, at most
    `width` columns: neighbouring bins merge when the span is wider. Empty: ("", 0, 0)."""
    used = [i for i, c in enumerate(hist) if c]
    if not used or width < 1:
        return "", 0, 0
    lo, hi = used[0], used[-1]
    pad = max(0, MIN_SPAN - (hi - lo + 1))
    lo = max(0, lo - pad // 2)
    hi = min(len(hist) - 1, max(hi, lo + MIN_SPAN - 1))
    per = -(-(hi - lo + 1) // width)
    cols = [sum(hist[i:min(i + per, hi + 1)]) for i in range(lo, hi + 1, per)]
    top = max(cols)
    bars = "".join(BARS[0] if c == 0 else BARS[max(1, round(c / top * (len(BARS) - 1)))] for c in cols)
    return bars, lo, min(hi, lo + per * len(cols) - 1)


def columns(width: int) -> tuple[tuple[str, ...], int, int]:
    """The percentiles that fit (p95 goes first), the label's width and each figure's."""
    return (("p50", "p95", "p99"), 6, 7) if width >= TABLE_WIDTH else (("p50", "p99"), 5, 6)


def metric_line(metric: str, s: Summary, width: int) -> str:
    shown, label, cell = columns(width)
    figures = "".join(f"{fmt_seconds(getattr(s, p)):>{cell}}" for p in shown)
    line = f"[b]{LABELS[metric]:<{label}}[/]{figures}{s.count:>{cell - 1}}"
    room = width - TABLE_WIDTH - 2
    if s.count and room >= HIST_MIN_WIDTH:
        labelled = room >= HIST_MIN_WIDTH + ENDS_WIDTH
        bars, lo, hi = hist_bars(s.hist, room - ENDS_WIDTH if labelled else room)
        line += f"  [$secondary]{bars}[/]"
        if labelled:
            line += f" [$text-muted]{fmt_seconds(HIST_EDGES[lo])}–{fmt_seconds(HIST_EDGES[hi + 1])}[/]"
    return line


def worker_line(name: str, view: LatencyView, index: int, width: int) -> str:
    """A worker's p99 of each metric; on a narrow panel queue time, then e2e, drop out."""
    table = view.workers.get(index, {})
    head = f"[b]{outside_markup(short_worker(name)):<6}[/]"
    parts = [(0, head)] + [(i + 1, f"{LABELS[m]} {fmt_seconds(table[m].p99)}")
                           for i, m in enumerate(("ttft", "itl", "e2e", "queue")) if m in table and table[m].count]
    if len(parts) == 1:
        return fit_parts([(0, head), (0, "[$text-muted]—[/]"), (1, "[$text-muted](none in the window)[/]")],
                         width, sep=" ")
    n = max(s.count for s in table.values())
    return fit_parts(parts + [(5, f"[$text-muted](n {n})[/]")], width, sep=" ")


def latency_markup(view: LatencyView | None, names: dict[int, str], width: int) -> str:
    if view is None:
        return "[$text-muted]no requests yet: press b for a burst[/]"
    shown, label, cell = columns(width)
    head = f"[$text-muted]{'':<{label}}" + "".join(f"{p:>{cell}}" for p in shown) + f"{'n':>{cell - 1}}[/]"
    lines = [head, *(metric_line(m, view.summary(m), width) for m in METRICS)]
    if names:
        lines.append("[$text-muted]p99 per worker[/]")
        lines += [worker_line(name, view, i, width) for i, name in names.items()]
    return "\n".join(lines)


class LatencyPanel(VerticalScroll):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.body = Static(latency_markup(None, {}, 80), classes="latency-body")
        self._shown = ""
        self._last: tuple[LatencyView | None, dict[int, str]] = (None, {})

    def compose(self):
        yield self.body

    def on_resize(self) -> None:
        self.show_latency(*self._last)

    def show_latency(self, view: LatencyView | None, names: dict[int, str]) -> None:
        self._last = (view, names)
        text = latency_markup(view, names, self.scrollable_content_region.width or 80)
        if text != self._shown:
            layout = text.count("\n") != self._shown.count("\n")
            self._shown = text
            self.body.update(text, layout=layout)


PANEL = PanelSpec(LatencyPanel, id="latency", box="latency", row="middle", title="latency",
                  draw=lambda panel, f: panel.show_latency(f.snap.latency.get(f.latency_window), f.names))
