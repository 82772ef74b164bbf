"""A throughput sparkline: one column per sample, newest on the right, scaled from zero.

Textual's Sparkline stretches however many samples it has over its width and scales from
the minimum to the maximum, which turns a steady 2,540-2,551 tok/s into wild swings. Rates
read better from a zero baseline, and a fresh worker should show a short history, not a
stretched one.
"""
from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

BARS = "▁▂▃▄▅▆▇█"


def spark_bars(samples: tuple[float, ...], width: int) -> str:
    """The last `width` samples as bars, right-aligned; zero is blank, any positive rate shows."""
    shown = samples[-width:] if width > 0 else ()
    top = max(shown, default=0.0)
    out = []
    for v in shown:
        if v <= 0 or top <= 0:
            out.append(" ")
        else:
            out.append(BARS[min(len(BARS) - 1, int(v / top * (len(BARS) - 1) + 0.5))])
    return " " * (max(0, width) - len(out)) + "".join(out)


class RateSparkline(Widget):
    COMPONENT_CLASSES = {"rate-sparkline--bar"}

    DEFAULT_CSS = """
    RateSparkline { height: 1; width: 1fr; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._samples: tuple[float, ...] = ()

    def update_samples(self, samples: tuple[float, ...]) -> None:
        if samples != self._samples:
            self._samples = samples
            self.refresh()

    def render(self) -> Text:
        bars = spark_bars(self._samples, self.size.width)
        return Text(bars, style=self.get_component_rich_style("rate-sparkline--bar"), no_wrap=True)
