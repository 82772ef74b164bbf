"""The request timeline: one lane per request, newest on top, on a time axis shared by all.

Each lane shows the request's phases (engine/facade/timeline.py; the names of its trace
lifecycle and of RequestState) across the last `span` seconds, the worker it runs on, and
how it ended. A column where a prefill chunk or a speculative verify round ended is drawn
denser. The axis follows the engine's clock, or stands still while paused (space), so a
moment can be read; + and - zoom. Only the lanes on screen are drawn: a line is worked out
when Textual paints it, so hundreds of requests cost what the visible ones do. A click on a
lane opens that request's detail, as Enter does.
"""
from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from textual.binding import Binding
from textual.geometry import Region, Size
from textual.message import Message
from textual.strip import Strip

from app.widgets.fmt import short_worker
from app.widgets.cursor import CursorView
from app.widgets.requests import request_number
from app.widgets.scroll import set_virtual_size
from app.widgets.panel import PanelSpec
from engine.facade.snapshot import EngineSnapshot, RequestState
from engine.facade.timeline import Timeline
from engine.outside import visible

# phase -> (glyph, theme colour); a tick (chunk or verify round) in a column -> the dense glyph
PHASE_LOOK = {"queued": ("·", "text-muted"), "waiting-on-leader": ("~", "accent"), "prefill": ("▒", "warning"),
              "decode": ("█", "success"), "preempted": ("░", "error")}
TICK_GLYPH = "▓"
TICK_OF = {"prefill": "prefill", "spec": "decode"}     # a tick kind -> the phase it shows in
END_LOOK = {"finished": ("✓", "success"), "aborted": ("⊘", "text-muted"), "error": ("✗", "error")}
SPANS = (5.0, 10.0, 30.0, 60.0, 120.0, 300.0)      # seconds across the lanes (+ and - step through)
LABEL = 12       # "r123  gpu0  "


def lane_cells(t: Timeline, start: float, step: float, width: int) -> list[tuple[str, str]]:
    """(glyph, colour) per column, column i covering [start + i*step, start + (i+1)*step): the
    phase in force at its middle, denser where a tick of that phase (a prefill chunk in prefill,
    a verify round in decode) falls in it, the end's mark in the column where it ended."""
    cells: list[tuple[str, str]] = []
    phases, ticks = t.phases, t.ticks
    p = k = 0
    for col in range(width):
        lo, hi = start + col * step, start + (col + 1) * step
        mid = (lo + hi) / 2
        if t.end is not None and lo <= t.end[1] < hi:
            cells.append(END_LOOK.get(t.end[0], ("|", "text")))
            continue
        if not phases or mid < phases[0][1] or (t.end is not None and lo > t.end[1]):
            cells.append((" ", ""))
            continue
        while p + 1 < len(phases) and phases[p + 1][1] <= mid:
            p += 1
        while k < len(ticks) and ticks[k][1] < lo:
            k += 1
        phase = phases[p][0]
        glyph, colour = PHASE_LOOK.get(phase, ("?", "text"))
        j = k
        while j < len(ticks) and ticks[j][1] < hi:
            if TICK_OF.get(ticks[j][0]) == phase:
                glyph = TICK_GLYPH
                break
            j += 1
        cells.append((glyph, colour))
    return cells


def axis_text(span: float, width: int) -> str:
    """The time axis over the lanes: the age of a few columns, 'now' at the right."""
    line = [" "] * width
    marks = 4 if width >= 40 else 2
    for i in range(marks + 1):
        col = round(i * (width - 1) / marks)
        label = "now" if i == marks else f"-{span * (1 - i / marks):g}s"
        at = max(0, min(width - len(label), col - (len(label) - 1 if i == marks else 0)))
        if all(c == " " for c in line[max(0, at - 1):at + len(label)]):
            line[at:at + len(label)] = label
    return "".join(line)


class TimelinePanel(CursorView):
    COMPONENT_CLASSES = {"timeline--header", "timeline--cursor"}
    BINDINGS = [
        Binding("space", "pause", "Pause", show=False),
        Binding("plus,equals_sign", "zoom(-1)", "Zoom in", show=False),
        Binding("minus", "zoom(1)", "Zoom out", show=False),
    ]

    class Changed(Message):
        """Paused, resumed or zoomed: the panel's title says so."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.span = 30.0
        self.paused = False
        self.pausable = True    # space pauses it; a replay takes space to pause the recording
        self._lanes: list[tuple[str, str, RequestState, Timeline]] = []   # id, worker, state, timeline
        self._clock = 0.0

    # --- data -------------------------------------------------------------------------------
    @property
    def row_count(self) -> int:
        return len(self._lanes)

    lane_count = row_count

    def row_id(self, row: int) -> str:
        return self._lanes[row][0]

    def box_title(self) -> str:
        if not self.pausable:
            return f"timeline · {self.span:g} s (+ -, g: table)"
        return f"timeline · {self.span:g} s · {'paused' if self.paused else 'live'} (space, + -, g: table)"

    def show_snapshot(self, snap: EngineSnapshot) -> None:
        """Lanes from the snapshot's requests and timelines, unless paused."""
        if self.paused:
            return
        names = {w.index: w.name for w in snap.workers}
        lanes = []
        for r in snap.requests:
            t = snap.timelines.get(r.id)
            if t is not None:
                worker = "-" if r.worker is None else short_worker(names.get(r.worker, str(r.worker)))
                lanes.append((r.id, worker, r.state, t))
        lanes.sort(key=lambda lane: -request_number(lane[0]))
        self._lanes, self._clock = lanes, snap.clock
        ids = [lane[0] for lane in lanes]
        self._cursor = ids.index(self._selected) if self._selected in ids else 0
        self._selected = self.selected_id
        set_virtual_size(self, Size(self.size.width, len(lanes) + 1))
        self._scroll_to_cursor()
        self.refresh()

    # --- keys -------------------------------------------------------------------------------
    def action_pause(self) -> None:
        self.paused = not self.paused
        self.post_message(self.Changed())

    def action_zoom(self, direction: int) -> None:
        i = min(range(len(SPANS)), key=lambda j: abs(SPANS[j] - self.span))
        self.span = SPANS[max(0, min(len(SPANS) - 1, i + direction))]
        self.post_message(self.Changed())
        self.refresh()

    # --- drawing ----------------------------------------------------------------------------
    def render_lines(self, crop: Region) -> list[Strip]:
        colours = self.app.theme_variables
        looks = {name: Style(color=colours[name]) for name in ("accent", "warning", "success", "error")}
        looks["text-muted"] = Style(dim=True)      # a blend ("auto 60%"), not a colour Rich can parse
        self._styles = (self.rich_style, self.get_component_rich_style("timeline--header"),
                        self.get_component_rich_style("timeline--cursor"), looks)
        return super().render_lines(crop)

    def render_line(self, y: int) -> Strip:
        base, header, cursor, looks = self._styles
        width = self.scrollable_content_region.width
        bars = max(0, width - LABEL)
        if y == 0:
            return Strip([Segment(" " * LABEL + axis_text(self.span, bars), base + header)]).crop_extend(0, width, base)
        index = int(self.scroll_y) + y - 1
        if index >= len(self._lanes):
            return Strip.blank(width, base)
        rid, worker, state, timeline = self._lanes[index]
        if index == self._cursor:
            base += cursor
        segments = [Segment(f"{visible(rid):<6}{visible(worker)[:5]:<6}"[:LABEL], base)]
        step = self.span / bars if bars else self.span
        run_text, run_colour = "", None
        for glyph, colour in lane_cells(timeline, self._clock - self.span, step, bars):
            if colour != run_colour and run_text:
                segments.append(Segment(run_text, base + looks.get(run_colour, Style())))
                run_text = ""
            run_text += glyph
            run_colour = colour
        if run_text:
            segments.append(Segment(run_text, base + looks.get(run_colour, Style())))
        return Strip(segments).crop_extend(0, width, base)


PANEL = PanelSpec(TimelinePanel, id="timeline", box="requests", row="middle", hidden=True,
                  key="toggle_timeline", draw=lambda timeline, f: timeline.show_snapshot(f.snap))
