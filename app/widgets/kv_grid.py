"""A compact picture of a worker's KV page pool: one cell per page, wrapped to the widget.

When the pool has more pages than the widget has cells, each cell stands for N consecutive
pages and shows the most notable state among them (shared > used > cached > free), so a
single busy page is never hidden by its free neighbours. Glyphs differ per state as well as
colours, so the grid still reads on a monochrome terminal.
"""
from __future__ import annotations

import numpy as np
from rich.style import Style
from rich.text import Text
from textual.widget import Widget

from engine.kv.states import CACHED, FREE, SHARED, STATE_NAMES, USED

GLYPHS = {FREE: "·", USED: "█", SHARED: "▓", CACHED: "▒"}
# Ranking used when one cell covers several pages: the highest rank wins.
_STATE_OF_RANK = (FREE, CACHED, USED, SHARED)
_RANK_OF_STATE = np.array([_STATE_OF_RANK.index(s) for s in range(4)], dtype=np.uint8)


def pages_per_cell(num_pages: int, cells: int) -> int:
    """Smallest N such that ceil(num_pages / N) cells fit into `cells`."""
    if num_pages <= 0 or cells <= 0:
        return 1
    return max(1, -(-num_pages // cells))


def downsample(states: bytes, per_cell: int) -> list[int]:
    """Group `per_cell` consecutive pages into one cell holding the most notable state."""
    if per_cell <= 1:
        return list(states)
    ranks = _RANK_OF_STATE[np.frombuffer(states, dtype=np.uint8) & 3]
    pad = (-len(ranks)) % per_cell
    if pad:
        ranks = np.concatenate([ranks, np.zeros(pad, dtype=np.uint8)])
    cell_ranks = ranks.reshape(-1, per_cell).max(axis=1)
    return [_STATE_OF_RANK[r] for r in cell_ranks.tolist()]


class KVGrid(Widget):
    """Renders `page_states` (bytes, one per page) as wrapped rows of state glyphs."""

    COMPONENT_CLASSES = {"kvgrid--free", "kvgrid--used", "kvgrid--shared", "kvgrid--cached"}

    DEFAULT_CSS = """
    KVGrid { height: 1fr; min-height: 1; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._states = b""

    @property
    def per_cell(self) -> int:
        """Pages per cell at the current size (1 = every page has its own cell)."""
        return pages_per_cell(len(self._states), self.size.width * self.size.height)

    def update_states(self, states: bytes) -> None:
        if states != self._states:
            self._states = states
            self.refresh()

    def on_resize(self) -> None:
        self.refresh()

    def render(self) -> Text:
        width, height = self.size.width, self.size.height
        if not self._states or width <= 0 or height <= 0:
            return Text("")
        cells = downsample(self._states, pages_per_cell(len(self._states), width * height))
        styles = {s: self.get_component_rich_style(f"kvgrid--{STATE_NAMES[s]}") for s in GLYPHS}
        text = Text(no_wrap=True, overflow="crop")
        for row_start in range(0, len(cells), width):
            if row_start:
                text.append("\n")
            _append_runs(text, cells[row_start:row_start + width], styles)
        return text


def _append_runs(text: Text, cells: list[int], styles: dict[int, Style]) -> None:
    """Append cells as runs of equal state: a few spans per row instead of one per cell."""
    start = 0
    for i in range(1, len(cells) + 1):
        if i == len(cells) or cells[i] != cells[start]:
            state = cells[start]
            text.append(GLYPHS[state] * (i - start), styles[state])
            start = i
