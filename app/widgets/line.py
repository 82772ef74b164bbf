"""A one-line Static that repaints only when its markup actually changes."""
from __future__ import annotations

from textual.widgets import Static


class Line(Static):
    DEFAULT_CSS = """
    Line { height: 1; width: 1fr; text-wrap: nowrap; text-overflow: ellipsis; }
    """

    def __init__(self, markup: str = "", **kwargs) -> None:
        super().__init__(markup, **kwargs)
        self._markup = markup

    def set(self, markup: str) -> None:
        # Fixed height: a changed text never changes the layout, so skip the layout pass.
        if markup != self._markup:
            self._markup = markup
            self.update(markup, layout=False)
