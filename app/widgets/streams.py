"""Live token streams: the tail of each active request's text, labelled and coloured per request.

The most recently finished requests stay a little longer (dimmed) so a short answer can be
read. The text is wrapped here, by characters, so the newest tokens are always on the last
visible line. The panel draws its own lines (a Line API view, like the request table):
streams that come, go or grow change what it draws, not the screen's layout, and only the
streams on screen are styled and drawn.
"""
from __future__ import annotations

import bisect
import heapq

from textual.content import Content
from textual.geometry import Region, Size
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.visual import Visual

from app.widgets.fmt import short_worker
from app.widgets.requests import request_number
from app.widgets.scroll import set_virtual_size
from app.widgets.panel import PanelSpec
from engine.facade.snapshot import LIVE_STATES, RequestState, RequestView
from engine.outside import visible

ACTIVE = LIVE_STATES
KEEP_FINISHED = 4
MAX_STREAMS = 24
TAIL_LINES = 3          # lines of text per stream at most
PALETTE = ("$primary", "$secondary", "$accent", "$success", "$warning")


def streams_to_show(requests: tuple[RequestView, ...]) -> list[RequestView]:
    """Active requests plus the few most recently finished ones, oldest first."""
    active = [r for r in requests if r.state in ACTIVE]
    done = heapq.nsmallest(KEEP_FINISHED, (r for r in requests if r.state not in ACTIVE), key=lambda r: r.age)
    chosen = sorted(active + done, key=lambda r: request_number(r.id))
    return chosen[-MAX_STREAMS:]


def stream_lines(label: str, text: str, width: int, max_lines: int = TAIL_LINES) -> list[str]:
    """Label plus the tail of `text`, hard-wrapped at `width`: at most `max_lines` lines,
    the label always first, the newest character always last."""
    text = shown_text(text)
    budget = max(1, width * max_lines - len(label) - 1)
    if len(text) > budget:
        text = "…" + text[-(budget - 1):]
    plain = f"{label} {text}"
    return [plain[i:i + width] for i in range(0, len(plain), width)] or [label]


def shown_text(text: str) -> str:
    """A stream's text as drawn: newlines as a glyph (whole lines would waste a small panel),
    every other control character in caret notation."""
    return visible(text.replace("\r", "").replace("\n", "⏎"))


DRAFTED_STYLE = "$success"   # text of accepted draft tokens (speculative decoding)


def drafted_ranges(r: RequestView, label: str, width: int, max_lines: int = TAIL_LINES) -> list[tuple[int, int]]:
    """Where the accepted-draft text of r.drafted_spans lands in stream_lines' output joined
    by newlines (the same cut and wrap; a stray \r shifts it by a character at most)."""
    if not r.drafted_spans or not r.text_tail:
        return []
    tail = r.text_tail
    n = len(shown_text(tail))
    as_drawn = n == len(tail.replace("\r", ""))

    def shown_at(i: int) -> int:
        """Where offset i of the tail is drawn: a control character before it is drawn wider (^[)."""
        return i if as_drawn else len(shown_text(tail[:i]))
    budget = max(1, width * max_lines - len(label) - 1)
    first, at = (n - (budget - 1), len(label) + 2) if n > budget else (0, len(label) + 1)
    out = []
    for a, b in r.drafted_spans:
        a, b = max(shown_at(a), first), min(shown_at(b), n)
        if a < b:
            lo, hi = at + a - first, at + b - first          # in the unwrapped line
            out.append((lo + lo // width, hi + (hi - 1) // width))   # + one newline per wrap
    return out


def stream_label(r: RequestView, names: dict[int, str] | None = None) -> str:
    worker = "-" if r.worker is None else short_worker((names or {}).get(r.worker, f"w{r.worker}"))
    return visible(f" {r.id} {worker} ")


def stream_body(r: RequestView) -> str:
    body = r.text_tail or f"({r.state})"
    if r.state == RequestState.ERROR:
        body += f"  {r.error or 'error'}"
    elif r.state not in ACTIVE and r.text_tail:
        body += f"  ({r.state})"
    return body


def stream_wrap(label: str, width: int) -> int:
    """The width a stream is wrapped at: the panel's, or the label and a few characters."""
    return max(len(label) + 8, width)


def stream_content(r: RequestView, width: int, names: dict[int, str] | None = None) -> tuple[Content, int]:
    """The stream's rendering and its height in lines."""
    label = stream_label(r, names)
    wrap = stream_wrap(label, width)
    lines = stream_lines(label, stream_body(r), wrap)
    content = Content("\n".join(lines))
    if r.state != "error":
        for a, b in drafted_ranges(r, label, wrap):
            content = content.stylize(DRAFTED_STYLE, a, b)
    content = content.stylize(f"bold reverse {PALETTE[request_number(r.id) % len(PALETTE)]}", 0, len(label))
    if r.state == RequestState.ERROR:
        content = content.stylize("$error", len(label) + 1, len(content))
    elif r.state not in ACTIVE or not r.text_tail:
        content = content.stylize("$text-muted", len(label) + 1, len(content))
    return content, len(lines)


EMPTY = Content.from_markup("[$text-muted]no active requests[/]")


class StreamsPanel(ScrollView, can_focus=True):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        # the streams shown, oldest first: (request, what it shows: its state and text lines)
        self._streams: list[tuple[RequestView, tuple[str, str]]] = []
        self._starts: list[int] = []         # each stream's first line
        self._height = 0                     # lines of all the streams
        self._names: dict[int, str] | None = None
        self._width = 0                      # the width the streams are wrapped at
        self._end = 0                        # scroll_y with the newest line at the bottom, when last drawn
        self._drawn: dict[int, list[Strip]] = {}   # stream -> its lines, styled in this paint
        self._last: tuple[tuple[RequestView, ...], dict[int, str] | None] = ((), None)

    @property
    def shown_ids(self) -> list[str]:
        """The requests whose streams are shown, oldest first."""
        return [r.id for r, _ in self._streams]

    def on_resize(self) -> None:
        # Streams are wrapped here to the panel's width: wrap them again at the new one.
        self.show_streams(*self._last)

    def show_streams(self, requests: tuple[RequestView, ...], names: dict[int, str] | None = None) -> None:
        self._last = (requests, names)
        width = max(20, self.scrollable_content_region.width)
        # At the bottom when last drawn (a resize since moves the bottom): keep the newest in view.
        following = self.scroll_y >= min(self._end, self.max_scroll_y)
        wanted = streams_to_show(requests)
        shown, starts, top = [], [], 0
        for r in wanted:
            label = stream_label(r, names)
            lines = stream_lines(label, stream_body(r), stream_wrap(label, width))
            shown.append((r.state, "\n".join(lines)))
            starts.append(top)
            top += len(lines)
        streams = list(zip(wanted, shown))
        if width == self._width and [(r.id, s) for r, s in streams] == [(r.id, s) for r, s in self._streams]:
            return       # nothing new to draw
        self._streams = streams
        self._starts, self._height, self._names, self._width = starts, top, names, width
        set_virtual_size(self, Size(width, top))
        if following:
            self.scroll_end(animate=False, immediate=bool(self.size), x_axis=False)
        self._end = self.max_scroll_y
        self.refresh()

    def render_lines(self, crop: Region) -> list[Strip]:
        # A stream is styled once per paint, for the lines of it on screen.
        self._drawn = {}
        return super().render_lines(crop)

    def _draw(self, content: Content) -> list[Strip]:
        return Visual.to_strips(self, content, self.scrollable_content_region.width, None, self.visual_style)

    def render_line(self, y: int) -> Strip:
        index = int(self.scroll_y) + y
        lines: list[Strip] = []
        if not self._streams:
            lines = self._draw(EMPTY)[index:]
        elif index < self._height:
            at = bisect.bisect_right(self._starts, index) - 1
            drawn = self._drawn.get(at)
            if drawn is None:
                r, _ = self._streams[at]
                drawn = self._drawn[at] = self._draw(stream_content(r, self._width, self._names)[0])
            lines = drawn[index - self._starts[at]:]
        return lines[0] if lines else Strip([])     # padded with the panel's background


PANEL = PanelSpec(StreamsPanel, id="streams", box="streams", row="bottom", title="streams",
                  draw=lambda panel, f: panel.show_streams(f.snap.requests, f.names))
