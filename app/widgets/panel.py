"""A titled, bordered box around dashboard panels (`z`, or a click on its title, zooms it), and
what a panel declares about itself (PanelSpec) and is handed at each refresh (Frame)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from textual.containers import Vertical
from textual.content import Content
from textual.events import Click

from engine.facade.snapshot import EngineSnapshot


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


@dataclass(frozen=True)
class Frame:
    """What one refresh hands every panel: the snapshot and the app's view settings."""
    snap: EngineSnapshot
    names: dict[int, str]        # worker index -> name
    latency_window: str          # the window `w` chose
    spec_mode: str | None        # speculation of new requests (the engine's, or the recording's)


@dataclass(frozen=True)
class PanelSpec:
    """What a panel is, declared in its widget's file; app/panels.py lists them and the app
    composes, mounts and feeds them from that list. Panels of one box take turns in it (a key
    swaps them); every box zooms (`z`, or a click on its title)."""
    widget: type                          # built as widget(id=id)
    id: str
    box: str                              # its titled box (`{box}-panel` in the stylesheet)
    row: str                              # "middle" or "bottom", left to right in list order
    draw: Callable[[Any, Frame], None]    # the part of the snapshot it shows
    title: str = ""                       # its box's title while it is shown
    min_width: int = 0                    # its box shows from this many terminal columns
    hidden: bool = False                  # starts hidden: its key swaps it in
    key: str | None = None                # that key's action
