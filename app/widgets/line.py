"""A one-line Static that repaints only when its markup actually changes."""
from __future__ import annotations

from textual.widgets import Static

from app.widgets.fmt import fit_parts


class Line(Static):
    DEFAULT_CSS = """
    Line { height: 1; width: 1fr; text-wrap: nowrap; text-overflow: ellipsis; }
    """

    def __init__(self, markup: str = "", **kwargs) -> None:
        super().__init__(markup, **kwargs)
        self._markup = markup
        self._parts: tuple[list[tuple[int, str]], str, str] | None = None

    def set(self, markup: str) -> None:
        self._parts = None
        self._show(markup)

    def set_parts(self, parts: list[tuple[int, str]], sep: str = " · ", prefix: str = "") -> None:
        """(priority, markup) fields: on a narrow line the lowest-priority ones drop out
        whole (higher number = lower priority) instead of the end being cut off."""
        self._parts = (parts, sep, prefix)
        self._fit()

    def _fit(self) -> None:
        parts, sep, prefix = self._parts
        width = self.size.width - len(prefix) if self.size.width else 10_000
        self._show(prefix + fit_parts(parts, width, sep))

    def on_resize(self) -> None:
        if self._parts is not None:
            self._fit()

    def _show(self, markup: str) -> None:
        # Fixed height: a changed text never changes the layout, so skip the layout pass.
        if markup != self._markup:
            self._markup = markup
            self.update(markup, layout=False)
