"""The request table: one row per request the engine still remembers, newest first.

A Line API widget rather than a DataTable: under a burst every active row's timings change
at every refresh, and DataTable re-renders each visible cell through Rich (about 1 ms a
cell), which keeps the UI thread busy. Here a row is a handful of segments, only the rows
on screen are worked out and drawn, and nothing is drawn at all when none of them changed.

Selection: until the user moves the cursor, it follows the newest live request (or the
newest request when none is live); once moved, it stays on the request it is on while newer
requests push it down. Either way the selected row is scrolled into view, so what x and
Enter act on is always on screen. A click on a row selects it and asks for its detail
(RequestChosen), as Enter does.
"""
from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from textual.geometry import Region, Size
from textual.strip import Strip

from app.widgets.fmt import fmt_seconds, short_worker
from app.widgets.cursor import CursorView
from app.widgets.scroll import set_virtual_size
from app.widgets.panel import PanelSpec
from engine.facade.snapshot import LIVE_STATES, RequestState, RequestView
from engine.outside import visible

# (header, width). The columns that matter most come first: on a narrow terminal the last
# ones are cut off (left / right scroll, z zooms the panel).
COLUMNS = (("id", 5), ("w", 5), ("state", 10), ("out", 9), ("TTFT", 6), ("ITL", 5), ("e2e", 6),
           ("end", 24), ("prompt", 6), ("cached", 6), ("spec", 11))
TABLE_WIDTH = sum(w for _, w in COLUMNS) + len(COLUMNS) - 1
STATE_COLOUR = {RequestState.PREFILL: "warning", RequestState.DECODE: "success", RequestState.ERROR: "error"}
DIM_STATES = (RequestState.QUEUED, RequestState.ABORTED)
LIVE = LIVE_STATES


def end_text(r: RequestView) -> str:
    """How it ended: the finish reason (stop, length, abort) or the error; blank while live."""
    if r.error:
        return r.error
    return {"abort": "aborted"}.get(r.finish_reason, r.finish_reason or "")


def state_of(cell: str) -> str:
    """The state behind a state cell ('follow r5' is a queued request waiting on r5)."""
    return RequestState.QUEUED if cell.startswith("follow ") else cell


def shown_state(r: RequestView) -> str:
    """The state its row shows (state_of its state cell)."""
    return RequestState.QUEUED if r.leader else r.state


def request_cells(r: RequestView, names: dict[int, str] | None = None) -> tuple[str, ...]:
    """A row's cells, as drawn: what came from outside (ids, names, errors) in caret notation."""
    worker = "-" if r.worker is None else short_worker((names or {}).get(r.worker, str(r.worker)))
    state = f"follow {r.leader}" if r.leader else r.state    # single flight: waits on r.leader
    return tuple(visible(cell) for cell in (
        r.id, worker, state, f"{r.output_tokens}/{r.max_tokens}", fmt_seconds(r.ttft), fmt_seconds(r.itl_mean),
        fmt_seconds(r.e2e), end_text(r), str(r.prompt_tokens), str(r.cached_tokens), spec_text(r)))


def spec_text(r: RequestView) -> str:
    """Speculation mode and acceptance rate, e.g. 'ngram 86%'; blank when not speculating."""
    s = r.spec
    if not s:
        return ""
    rate = s.get("acceptance_rate")
    return f"{s['mode']} {'—' if rate is None else f'{100 * rate:.0f}%'}"


def request_number(request_id: str) -> int:
    """Engine ids are r1, r2, ...: order by the number, not the string."""
    digits = request_id.lstrip("r")
    return int(digits) if digits.isdigit() else 0


def row_text(cells: tuple[str, ...]) -> list[str]:
    return [cell[:width].ljust(width) for cell, (_, width) in zip(cells, COLUMNS)]


class RequestsTable(CursorView):
    COMPONENT_CLASSES = {"requests-table--header", "requests-table--cursor"}

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._views: list[RequestView] = []     # newest first
        self._names: dict[int, str] | None = None
        self._cells: dict[int, tuple[str, ...]] = {}    # row -> its cells, once worked out
        self._drawn: tuple | None = None        # what the rows on screen showed when last refreshed
        self._follow = True        # the cursor follows the newest live request until moved

    # --- data ------------------------------------------------------------------------------
    @property
    def row_count(self) -> int:
        return len(self._views)

    def row_id(self, row: int) -> str:
        return self._views[row].id

    def row_cells(self, request_id: str) -> tuple[str, ...] | None:
        """The cells of a request's row (None: no row for it)."""
        return next((self._cells_at(i) for i, r in enumerate(self._views) if r.id == request_id), None)

    def _cells_at(self, row: int) -> tuple[str, ...]:
        cells = self._cells.get(row)
        if cells is None:
            cells = self._cells[row] = request_cells(self._views[row], self._names)
        return cells

    def show_requests(self, requests: tuple[RequestView, ...], names: dict[int, str] | None = None) -> None:
        # Every request is kept and ordered (the cursor and the scroll range need them all);
        # only the rows on screen are formatted, here to see whether anything there changed.
        self._views = sorted(requests, key=lambda r: -request_number(r.id))
        self._names, self._cells = names, {}
        ids = [r.id for r in self._views]
        if self._follow or self._selected not in ids:
            self._follow = True
            self._cursor = next((i for i, r in enumerate(self._views) if shown_state(r) in LIVE), 0)
        else:
            self._cursor = ids.index(self._selected)
        self._selected = self.selected_id
        set_virtual_size(self, Size(TABLE_WIDTH, len(self._views) + 1))
        self._scroll_to_cursor()
        top = int(self.scroll_y)
        bottom = min(len(self._views), top + max(1, self.size.height - 1))
        drawn = (len(self._views), self._cursor, top, tuple(self._cells_at(i) for i in range(top, bottom)))
        if drawn != self._drawn:
            self._drawn = drawn
            self.refresh()

    def cursor_moved(self) -> None:
        self._follow = False

    # --- rendering --------------------------------------------------------------------------
    def render_lines(self, crop: Region) -> list[Strip]:
        # Styles are resolved once per paint, not per line (rich_style walks the ancestors).
        self._styles = (self.rich_style, self.get_component_rich_style("requests-table--header"),
                        self.get_component_rich_style("requests-table--cursor"))
        return super().render_lines(crop)

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        base, header, cursor = self._styles
        width = self.size.width
        if y == 0:
            text = " ".join(name.ljust(w) for name, w in COLUMNS)
            return Strip([Segment(text, base + header)]).crop_extend(scroll_x, scroll_x + width, base)
        index = scroll_y + y - 1
        if index >= len(self._views):
            return Strip.blank(width, base)
        cells = self._cells_at(index)
        if index == self._cursor:
            base += cursor
        state = state_of(cells[2])
        colours = self.app.theme_variables
        if state in STATE_COLOUR:
            state_style = Style(color=colours[STATE_COLOUR[state]], bold=state == "error")
        else:
            state_style = Style(dim=state in DIM_STATES)
        texts = row_text(cells)
        end_style = state_style if state == "error" else Style(dim=True)
        segments = [Segment(" ".join(texts[:2]) + " ", base),
                    Segment(texts[2], base + state_style),
                    Segment(" " + " ".join(texts[3:7]) + " ", base),
                    Segment(texts[7], base + end_style),
                    Segment(" " + " ".join(texts[8:]), base)]
        return Strip(segments).crop_extend(scroll_x, scroll_x + width, base)


PANEL = PanelSpec(RequestsTable, id="requests", box="requests", row="middle", title="requests",
                  draw=lambda table, f: table.show_requests(f.snap.requests, f.names))
