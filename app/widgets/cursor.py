"""A line-drawn list with one header line and a row cursor: the request table and the timeline.

Up/down, page up/down, home/end move the cursor; the cursor's row is kept on screen; a click
on a row moves the cursor there and asks for that request's detail (RequestChosen), as Enter
does. A subclass says how many rows it has and which request each one is.
"""
from __future__ import annotations

from textual.binding import Binding
from textual.events import Click
from textual.message import Message
from textual.scroll_view import ScrollView

from app.widgets.scroll import keep_row_in_view


class RequestChosen(Message):
    """A request's row (or timeline lane) was clicked: the app opens its detail, as Enter does."""

    def __init__(self, request_id: str) -> None:
        super().__init__()
        self.request_id = request_id


class CursorView(ScrollView, can_focus=True):
    BINDINGS = [
        Binding("up", "cursor(-1)", "Up", show=False),
        Binding("down", "cursor(1)", "Down", show=False),
        Binding("pageup", "page(-1)", "Page up", show=False),
        Binding("pagedown", "page(1)", "Page down", show=False),
        Binding("home", "cursor(-1000000)", "First", show=False),
        Binding("end", "cursor(1000000)", "Last", show=False),
    ]

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._cursor = 0
        self._selected: str | None = None

    @property
    def row_count(self) -> int:
        raise NotImplementedError

    def row_id(self, row: int) -> str:
        raise NotImplementedError

    def cursor_moved(self) -> None:
        """The user moved the cursor (a subclass may stop following the newest request)."""

    @property
    def selected_id(self) -> str | None:
        return self.row_id(self._cursor) if self.row_count else None

    def action_cursor(self, delta: int) -> None:
        self.move_cursor(self._cursor + delta)

    def action_page(self, direction: int) -> None:
        self.move_cursor(self._cursor + direction * max(1, self.size.height - 1))

    def move_cursor(self, row: int) -> None:
        if not self.row_count:
            return
        self.cursor_moved()
        self._cursor = max(0, min(row, self.row_count - 1))
        self._selected = self.selected_id
        self._scroll_to_cursor()
        self.refresh()

    def _scroll_to_cursor(self) -> None:
        keep_row_in_view(self, self._cursor)

    def on_click(self, event: Click) -> None:
        row = int(self.scroll_y) + event.y - 1      # line 0 is the header
        if event.y >= 1 and row < self.row_count:
            self.move_cursor(row)
            self.post_message(RequestChosen(self.row_id(row)))
