"""A titled, bordered box around one dashboard panel; `z`, or a click on its title, zooms it."""
from __future__ import annotations

from textual.containers import Vertical
from textual.content import Content
from textual.events import Click


class Panel(Vertical):
    ALLOW_MAXIMIZE = True

    def __init__(self, title: str, *children, **kwargs) -> None:
        super().__init__(*children, **kwargs)
        self.add_class("panel")
        self.border_title = title

    def on_click(self, event: Click) -> None:
        # The title sits on the top border, one cell in from the corner, padded by a space each side.
        title = self.border_title
        if (event.widget is self and event.y == 0 and title
                and 1 <= event.x <= Content.from_markup(title).cell_length + 2):
            event.stop()
            self.toggle_zoom()

    def toggle_zoom(self) -> None:
        """The whole screen for this panel, or back; the focus moves into it, so `z` (which
        zooms the focused panel) and the highlighted border agree with what is shown."""
        screen = self.screen
        if screen.maximized is self:
            screen.minimize()
            return
        screen.maximize(self, container=False)
        if self.screen.focused is None or self not in self.screen.focused.ancestors:
            for child in self.query("*"):
                if child.focusable and child.display:
                    child.focus()
                    break
