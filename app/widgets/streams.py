"""Live token streams: the tail of each active request's text, labelled and coloured per request.

Each stream is one widget keyed by request id, rewritten only when its text grows; the most
recently finished requests stay a little longer (dimmed) so a short answer can be read.
The text is wrapped here, by characters, so the newest tokens are always on the last
visible line and a stream's height changes only when its line count does (a layout pass
for the whole screen is the most expensive thing a refresh can trigger).
"""
from __future__ import annotations

from textual.containers import VerticalScroll
from textual.content import Content
from textual.widgets import Static

from app.widgets.fmt import short_worker
from app.widgets.requests import request_number
from engine.facade.snapshot import LIVE_STATES, RequestState, RequestView

ACTIVE = LIVE_STATES
KEEP_FINISHED = 4
MAX_STREAMS = 24
TAIL_LINES = 3          # lines of text per stream at most
PALETTE = ("$primary", "$secondary", "$accent", "$success", "$warning")


def streams_to_show(requests: tuple[RequestView, ...]) -> list[RequestView]:
    """Active requests plus the few most recently finished ones, oldest first."""
    active = [r for r in requests if r.state in ACTIVE]
    done = sorted((r for r in requests if r.state not in ACTIVE), key=lambda r: r.age)[:KEEP_FINISHED]
    chosen = sorted(active + done, key=lambda r: request_number(r.id))
    return chosen[-MAX_STREAMS:]


def stream_lines(label: str, text: str, width: int, max_lines: int = TAIL_LINES) -> list[str]:
    """Label plus the tail of `text`, hard-wrapped at `width`: at most `max_lines` lines,
    the label always first, the newest character always last."""
    # Visible newlines would waste whole lines of a small panel; show them as a glyph.
    text = text.replace("\r", "").replace("\n", "⏎")
    budget = max(1, width * max_lines - len(label) - 1)
    if len(text) > budget:
        text = "…" + text[-(budget - 1):]
    plain = f"{label} {text}"
    return [plain[i:i + width] for i in range(0, len(plain), width)] or [label]


DRAFTED_STYLE = "$success"   # text of accepted draft tokens (speculative decoding)


def drafted_ranges(r: RequestView, label: str, width: int, max_lines: int = TAIL_LINES) -> list[tuple[int, int]]:
    """Where the accepted-draft text of r.drafted_spans lands in stream_lines' output joined
    by newlines (the same cut and wrap; a stray \r shifts it by a character at most)."""
    if not r.drafted_spans or not r.text_tail:
        return []
    n = len(r.text_tail.replace("\r", ""))
    budget = max(1, width * max_lines - len(label) - 1)
    first, at = (n - (budget - 1), len(label) + 2) if n > budget else (0, len(label) + 1)
    out = []
    for a, b in r.drafted_spans:
        a, b = max(a, first), min(b, n)
        if a < b:
            lo, hi = at + a - first, at + b - first          # in the unwrapped line
            out.append((lo + lo // width, hi + (hi - 1) // width))   # + one newline per wrap
    return out


def stream_content(r: RequestView, width: int, names: dict[int, str] | None = None) -> tuple[Content, int]:
    """The stream's rendering and its height in lines."""
    worker = "-" if r.worker is None else short_worker((names or {}).get(r.worker, f"w{r.worker}"))
    label = f" {r.id} {worker} "
    body = r.text_tail or f"({r.state})"
    if r.state == RequestState.ERROR:
        body += f"  {r.error or 'error'}"
    elif r.state not in ACTIVE and r.text_tail:
        body += f"  ({r.state})"
    wrap = max(len(label) + 8, width)
    lines = stream_lines(label, body, wrap)
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


class StreamsPanel(VerticalScroll):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._shown: dict[str, tuple[Static, tuple]] = {}   # request id -> (widget, what it shows)
        self._empty = Static("[$text-muted]no active requests[/]")
        self._last: tuple[tuple[RequestView, ...], dict[int, str] | None] = ((), None)

    def compose(self):
        yield self._empty

    def on_resize(self) -> None:
        # Streams are wrapped here to the panel's width: wrap them again at the new one.
        self.call_after_refresh(self.show_streams, *self._last)

    def show_streams(self, requests: tuple[RequestView, ...], names: dict[int, str] | None = None) -> None:
        self._last = (requests, names)
        wanted = streams_to_show(requests)
        width = max(20, self.scrollable_content_region.width)
        following = self.scroll_y >= self.max_scroll_y   # at the bottom: keep the newest in view
        keep = {r.id for r in wanted}
        for rid in [rid for rid in self._shown if rid not in keep]:
            self._shown.pop(rid)[0].remove()
        for r in wanted:
            content, height = stream_content(r, width, names)
            key = (r.state, content.plain)    # Content compares its text only, not its styles
            widget, shown = self._shown.get(r.id, (None, None))
            if widget is None:
                widget = Static(content, classes="stream")
                widget.styles.height = height
                self.mount(widget)
            elif shown != key:
                if widget.styles.height is None or widget.styles.height.value != height:
                    widget.styles.height = height
                widget.update(content, layout=False)
            self._shown[r.id] = (widget, key)
        self._empty.display = not wanted
        if following:
            self.call_after_refresh(self.scroll_end, animate=False)
