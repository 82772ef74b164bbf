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
    # What Textual does once a layout has sized a view: which scrollbars show (the flags are
    # layout reactives: a change asks for a layout), their windows, the scroll limits.
    if view.container_size:          # not laid out yet: the first layout does it all
        view.show_horizontal_scrollbar, view.show_vertical_scrollbar = scrollbars_needed(view, size)
    horizontal = view.show_horizontal_scrollbar and view.styles.scrollbar_size_horizontal
    vertical = view.show_vertical_scrollbar and view.styles.scrollbar_size_vertical
    width, height = view.container_size
    if vertical:
        bar = view.vertical_scrollbar
        bar.display = True
        bar.window_virtual_size, bar.window_size = size.height, height - view.scrollbar_size_horizontal
        bar.refresh()
    if horizontal:
        bar = view.horizontal_scrollbar
        bar.display = True
        bar.window_virtual_size, bar.window_size = size.width, width - view.scrollbar_size_vertical
        bar.refresh()
    view.scroll_x = view.validate_scroll_x(view.scroll_x)
    view.scroll_y = view.validate_scroll_y(view.scroll_y)    # a shorter view: not past its end
    view.refresh()


def scrollbars_needed(view: ScrollView, size: Size) -> tuple[bool, bool]:
    """(horizontal, vertical): which scrollbars a view of this scrollable size shows, by its
    overflow styles (one bar's room can make the other needed)."""
    styles = view.styles
    width, height = view.container_size

    def needed(overflow: str, extent: int, room: int) -> bool:
        return overflow == "scroll" or (overflow == "auto" and extent > room)

    vertical = needed(styles.overflow_y, size.height, height)
    horizontal = needed(styles.overflow_x, size.width, width - (styles.scrollbar_size_vertical if vertical else 0))
    if horizontal and not vertical:
        vertical = needed(styles.overflow_y, size.height, height - styles.scrollbar_size_horizontal)
    return horizontal, vertical


def keep_row_in_view(view, row: int) -> None:
    """Scroll a line-drawn view with one header line (the request table, the timeline) just
    enough that `row` is on screen."""
    visible = max(1, view.size.height - 1)          # minus the header line
    top = int(view.scroll_y)
    if row < top:
        view.scroll_to(y=row, animate=False, immediate=True)
    elif row >= top + visible:
        view.scroll_to(y=row - visible + 1, animate=False, immediate=True)
