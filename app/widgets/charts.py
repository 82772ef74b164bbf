"""History charts: decode and prefill tok/s, running and waiting requests, KV usage, per
worker, over the last 1, 5 or 15 minutes (m), with a time axis and a scale (textual-plot).

They take the streams panel's place when h is pressed, and z zooms them to the full screen;
the worker panels' sparklines stay where there is no room for a chart. The engine keeps one
point a second (engine/facade/history.py); a chart averages them over its columns of dots and
is redrawn when a column has filled.

textual-plot over textual-plotext: it redraws the same four series of 900 points in about
half the time (docs/architecture.md). Each chart's title and legend are one Line above it:
the plot's own legend is a widget whose update lays the screen out at every redraw.
"""
from __future__ import annotations

from typing import Sequence

from textual.containers import Grid, Vertical
from textual_plot import HiResMode, PlotWidget
from textual_plot.axis_formatter import AxisFormatter

from app.widgets.fmt import outside_markup, short_worker
from app.widgets.line import Line
from app.widgets.panel import PanelSpec
from engine.facade.history import WINDOWS_S, History

# chart id -> (title, [(series, label suffix)], scale)
CHARTS = {
    "decode": ("decode tok/s", [("decode_tps", "")], 1.0),
    "prefill": ("prefill tok/s", [("prefill_tps", "")], 1.0),
    "load": ("running · waiting (dotted)", [("running", ""), ("waiting", " wait")], 1.0),
    "kv": ("KV usage %", [("kv_usage", "")], 100.0),
}
SHORT_ROWS = 16          # below, two charts side by side (decode, KV) instead of four, too short to read
SPARE = ("prefill", "load")
NARROW_COLUMNS = 40      # below, three time ticks instead of five
COLOURS = ("primary", "warning", "success", "accent", "error", "secondary")    # a worker's, by its order


def window_label(seconds: int) -> str:
    return f"{seconds // 60} min"


def time_ticks(window: int, n: int = 5) -> tuple[list[float], list[str]]:
    """n ticks from -window to now, labelled in minutes (or seconds for the last minute)."""
    ticks = [-window + i * window / (n - 1) for i in range(n)]
    return ticks, [tick_label(x, window) for x in ticks]


def tick_label(x: float, window: int) -> str:
    if x == 0:
        return "now"
    return f"{x / 60:g}m" if window > 60 else f"{x:g}s"


class TimeAxis(AxisFormatter):
    """The x axis: ticks over the window (five, three on a narrow chart), as time before now."""

    def __init__(self, window: int, n: int = 5) -> None:
        self.window, self.n = window, n

    def get_ticks(self, min_: float, max_: float, max_ticks: int = 8) -> list[float]:
        return time_ticks(self.window, self.n)[0]

    def get_labels_for_ticks(self, ticks: Sequence[float]) -> list[str]:
        return [tick_label(x, self.window) for x in ticks]


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


def fit_columns(xs: list[float], ys: list[float], clock: float, step: float) -> tuple[list[float], list[float]]:
    """A series averaged over buckets of `step` seconds, one for each column of dots the chart
    has (x: the bucket's middle). Buckets are fixed in time, not to now, so a bucket's point
    stays put as the chart moves on."""
    sums: dict[int, list[float]] = {}
    for x, y in zip(xs, ys):
        acc = sums.setdefault(int((clock + x) // step), [0.0, 0])
        acc[0] += y
        acc[1] += 1
    return ([(b + 0.5) * step - clock for b in sums], [total / n for total, n in sums.values()])


class Chart(PlotWidget, can_focus=False):
    """A plot that is only looked at: no focus, so its pan and zoom keys (arrows, + -, r)
    never take the dashboard's."""

    def __init__(self, **kwargs) -> None:
        super().__init__(allow_pan_and_zoom=False, **kwargs)
        self.set_reactive(PlotWidget.margin_top, 0)       # the title is the Line above
        self.set_reactive(PlotWidget.margin_bottom, 1)    # the tick labels
        self.set_reactive(PlotWidget.margin_left, 7)

    def on_mount(self) -> None:
        self.show_legend(is_visible=False)

    @property
    def dot_columns(self) -> int:
        """Columns of dots across the plot: two a cell (braille), inside the margin and frame."""
        return max(2, 2 * (self.size.width - self.margin_left - 2))


def draw_chart(plot: Chart, title: Line, name: str, drawn: list[tuple[str, list[float], list[float], str]],
               window: int, colours: dict[str, str]) -> None:
    """One chart: its series (label, xs, ys, label suffix: a worker's waiting series is dotted),
    the axes over the window, and its title line with the legend in the series' colours."""
    heading, _, _ = CHARTS[name]
    plot.clear()
    legend, seen = [], {}
    for label, xs, ys, suffix in drawn:
        worker = label[:len(label) - len(suffix)] if suffix else label
        colour = colours[COLOURS[seen.setdefault(worker, len(seen)) % len(COLOURS)]]
        if suffix:
            plot.scatter(xs, ys, marker_style=colour, hires_mode=HiResMode.BRAILLE)
        else:
            plot.plot(xs, ys, line_style=colour, hires_mode=HiResMode.BRAILLE)
            legend.append(f"[{colour}]━[/] {outside_markup(worker)}")
    plot.set_x_formatter(TimeAxis(window, 3 if plot.size.width < NARROW_COLUMNS else 5))
    plot.set_xlimits(-window, 0)
    top = max((max(ys) for _, _, ys, _ in drawn), default=0.0)
    plot.set_ylimits(0, 100 if name == "kv" else max(1.0, top * 1.1))
    text = f"[b]{heading}[/]" if drawn else f"[b]{heading}[/]: no points yet"
    title.set("  ".join([text, *legend]))


class HistoryCharts(Grid, can_focus=True):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.window = WINDOWS_S[1]
        self._shown: dict[str, tuple] = {}     # chart -> what it last drew
        self.plotted: dict[str, list] = {}     # chart -> its series (label, xs, ys) before fit_columns
        self._last: tuple | None = None          # show_history's last arguments
        self.every_frame = False                  # replay: a position draws its own points, however reached

    def compose(self):
        for chart in CHARTS:
            with Vertical(classes="chart -spare" if chart in SPARE else "chart"):
                yield Line(id=f"chart-{chart}-title", classes="chart-title")
                yield Chart(id=f"chart-{chart}")

    def box_title(self) -> str:
        return f"history · {window_label(self.window)} (m, h: streams)"

    def cycle_window(self) -> int:
        self.window = WINDOWS_S[(WINDOWS_S.index(self.window) + 1) % len(WINDOWS_S)]
        self._shown.clear()
        return self.window

    def on_resize(self) -> None:
        self.set_class(self.size.height < SHORT_ROWS, "-short")
        # shown (h) or zoomed (z): the charts have other columns; redraw them from the last points
        if self._last is not None:
            self.call_after_refresh(self.show_history, *self._last)

    def show_history(self, history: dict[int, History], names: dict[int, str], clock: float) -> None:
        """Each chart redrawn when a column of its dots has filled: a point a second is more
        than a column holds (a 5-minute window over 80 columns: one every 3.75 s), and a
        redraw costs tens of milliseconds of the UI thread (docs/benchmarks.md, chart ms)."""
        self._last = (history, names, clock)
        colours = self.app.theme_variables
        for chart, (_, parts, scale) in CHARTS.items():
            plot = self.query_one(f"#chart-{chart}", Chart)
            step = self.window / plot.dot_columns
            series = [(label + suffix, xs, ys, suffix) for name, suffix in parts
                      for label, xs, ys in chart_series(history, names, clock, self.window, name, scale)]
            when = clock if self.every_frame else int(clock // step)
            key = (when, self.window, plot.size, tuple(label for label, *_ in series))
            if self._shown.get(chart) == key:
                continue
            self._shown[chart] = key
            self.plotted[chart] = [(label, xs, ys) for label, xs, ys, _ in series]
            drawn = [(label, *fit_columns(xs, ys, clock, step), suffix) for label, xs, ys, suffix in series]
            draw_chart(plot, self.query_one(f"#chart-{chart}-title", Line), chart, drawn, self.window, colours)


PANEL = PanelSpec(HistoryCharts, id="charts", box="streams", row="bottom", hidden=True, key="toggle_charts",
                  draw=lambda charts, f: charts.show_history(f.snap.history, f.names, f.snap.clock))
