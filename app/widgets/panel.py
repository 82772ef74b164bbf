"""A titled, bordered box around one dashboard panel; `z` zooms the one holding the focus."""
from __future__ import annotations

from textual.containers import Vertical


class Panel(Vertical):
    ALLOW_MAXIMIZE = True

    def __init__(self, title: str, *children, **kwargs) -> None:
        super().__init__(*children, **kwargs)
        self.add_class("panel")
        self.border_title = title
