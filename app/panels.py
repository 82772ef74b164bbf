"""The dashboard's panels, in the order they sit in their rows: each is declared in its widget's
file (its PANEL, an app.widgets.panel.PanelSpec); a new panel is one widget file and one line here.
"""
from __future__ import annotations

from typing import Iterable

from textual.app import ComposeResult
from textual.containers import Horizontal

from app.widgets import charts, event_log, latency, requests, routing, spec, streams, timeline
from app.widgets.panel import Frame, Panel, PanelSpec

PANELS: tuple[PanelSpec, ...] = (
    requests.PANEL,
    timeline.PANEL,
    latency.PANEL,
    routing.PANEL,
    streams.PANEL,
    charts.PANEL,
    spec.PANEL,
    event_log.PANEL,
)
ROWS = ("middle", "bottom")


def boxes(panels: Iterable[PanelSpec]) -> dict[str, list[PanelSpec]]:
    """Box name -> its panels, boxes in order of their first panel."""
    out: dict[str, list[PanelSpec]] = {}
    for p in panels:
        out.setdefault(p.box, []).append(p)
    return out


def compose_panels(panels: tuple[PanelSpec, ...] = PANELS) -> ComposeResult:
    """Each row a Horizontal of titled boxes; a hidden panel waits in its box for its key."""
    for row in ROWS:
        with Horizontal(id=row, classes="row"):
            for box, members in boxes(p for p in panels if p.row == row).items():
                widgets = []
                for p in members:
                    widget = p.widget(id=p.id)
                    widget.display = not p.hidden
                    widgets.append(widget)
                yield Panel(members[0].title, *widgets, id=f"{box}-panel")


def draw_panels(frame: Frame, shown: dict[str, object], boxes_by_name: dict[str, Panel], width: int,
                panels: tuple[PanelSpec, ...] = PANELS) -> None:
    """Show or hide each box by the terminal's width, then let every shown panel draw the frame."""
    for p in panels:
        box = boxes_by_name[p.box]
        if p.min_width:
            box.display = width >= p.min_width
        widget = shown[p.id]
        if box.display and widget.display:
            p.draw(widget, frame)
