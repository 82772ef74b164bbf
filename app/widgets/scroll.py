"""A line-API view's scrollable size, changed without a layout pass of the whole screen.

`ScrollView.virtual_size = ...` asks Textual for a layout of the screen (the reactive is
declared layout=True), yet a view that draws its own lines occupies the same region whatever
its content's height: only its scrollbars depend on it. The request table, the timeline and
the streams change their height whenever a request arrives or goes; with hundreds of requests
that is most refreshes, and a screen layout costs more than drawing the frame.
"""
from __future__ import annotations

from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.widget import Widget


def set_virtual_size(view: ScrollView, size: Size) -> None:
    """The view's new scrollable size; its scrollbars follow (their thumbs repainted, and a
    layout only where one appears or goes)."""
    if size == view.virtual_size:
        return
    view.set_reactive(Widget.virtual_size, size)
    # What Textual runs after a layout has sized the view: scroll limits, scrollbar windows
    # and visibility (a visibility change asks for its own layout).
    view._scroll_update(size)
    view.scroll_y = view.validate_scroll_y(view.scroll_y)    # a shorter view: not past its end
    view.refresh()


def keep_row_in_view(view, row: int) -> None:
    """Scroll a line-drawn view with one header line (the request table, the timeline) just
    enough that `row` is on screen."""
    visible = max(1, view.size.height - 1)          # minus the header line
    top = int(view.scroll_y)
    if row < top:
        view.scroll_to(y=row, animate=False, immediate=True)
    elif row >= top + visible:
        view.scroll_to(y=row - visible + 1, animate=False, immediate=True)
