"""History charts: decode and prefill tok/s, running and waiting requests, KV usage, per
worker, over the last 1, 5 or 15 minutes (m), with a time axis and a scale (textual-plotext).

They take the streams panel's place when h is pressed, and z zooms them to the full screen;
the worker panels' sparklines stay where there is no room for a chart. The engine keeps one
point a second (engine/facade/history.py), so a chart is redrawn at most once a second.
"""
from __future__ import annotations

from textual.containers import Grid
from textual_plotext import PlotextPlot

from app.widgets.fmt import short_worker
from engine.facade.history import WINDOWS_S, History

# chart id -> (title, [(series, label suffix)], scale)
CHARTS = {
    "decode": ("decode tok/s", [("decode_tps", "")], 1.0),
    "prefill": ("prefill tok/s", [("prefill_tps", "")], 1.0),
    "load": ("running · waiting (dotted)", [("running", ""), ("waiting", " wait")], 1.0),
    "kv": ("KV usage %", [("kv_usage", "")], 100.0),
}


def window_label(seconds: int) -> str:
    return f"{seconds // 60} min"


def time_ticks(window: int) -> tuple[list[float], list[str]]:
    """Five ticks from -window to now, labelled in minutes (or seconds for the last minute)."""
    ticks = [-window + i * window / 4 for i in range(5)]
    def label(x: float) -> str:
        if x == 0:
            return "now"
        return f"{x / 60:g}m" if window > 60 else f"{x:g}s"
    return ticks, [label(x) for x in ticks]


def chart_series(history: dict[int, History], names: dict[int, str], clock: float, window: int,
                 series: str, scale: float) -> list[tuple[str, list[float], list[float]]]:
    """(worker label, x seconds before now, y) of one series for each worker, within the window."""
    out = []
    for index in sorted(history):
        h = history[index]
        xs, ys = [], []
        for t, v in zip(h.times, h.values(series)):
            if t >= clock - window and v is not None:
                xs.append(t - clock)
                ys.append(v * scale)
        if xs:
            out.append((short_worker(names.get(index, f"w{index}")), xs, ys))
    return out


class HistoryCharts(Grid, can_focus=True):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.window = WINDOWS_S[1]
        self._shown: dict[str, tuple] = {}     # chart -> what it last drew
        self.plotted: dict[str, list] = {}     # chart -> the series it drew (label, xs, ys)

    def compose(self):
        for chart in CHARTS:
            yield PlotextPlot(id=f"chart-{chart}", classes="chart")

    def cycle_window(self) -> int:
        self.window = WINDOWS_S[(WINDOWS_S.index(self.window) + 1) % len(WINDOWS_S)]
        self._shown.clear()
        return self.window

    def show_history(self, history: dict[int, History], names: dict[int, str], clock: float) -> None:
        for chart, (title, parts, scale) in CHARTS.items():
            plot = self.query_one(f"#chart-{chart}", PlotextPlot)
            drawn = [(label + suffix, xs, ys, suffix) for series, suffix in parts
                     for label, xs, ys in chart_series(history, names, clock, self.window, series, scale)]
            key = (int(clock), self.window, tuple((label, len(xs), xs[-1] if xs else None) for label, xs, _, _ in drawn))
            if self._shown.get(chart) == key:
                continue
            self._shown[chart] = key
            self.plotted[chart] = [(label, xs, ys) for label, xs, ys, _ in drawn]
            plt = plot.plt
            plt.clear_data()
            plt.clear_figure()
            plt.title(title)
            for label, xs, ys, suffix in drawn:
                plt.plot(xs, ys, label=label, marker="dot" if suffix else "braille")
            ticks, labels = time_ticks(self.window)
            plt.xticks(ticks, labels)
            plt.xlim(-self.window, 0)
            top = max((max(ys) for _, _, ys, _ in drawn), default=0.0)
            plt.ylim(0, 100 if chart == "kv" else max(1.0, top * 1.1))
            if not drawn:
                plt.title(f"{title}: no points yet")
            plot.refresh()
