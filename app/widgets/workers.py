"""Every worker on screen, whatever their number: full panels side by side when they fit,
else one line each, htop-style (app/widgets/worker_line.py), with at most one worker shown in
full beside the lines (`e` steps through them, a click on a line picks it).

The lines never scroll out of sight: when there are more workers than rows to spare they are
laid out in columns, as htop lays out its CPU meters.
"""
from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Grid, Horizontal

from app.widgets.worker import WorkerPanel
from app.widgets.worker_line import WorkerLine
from engine.config import WorkerConfig
from engine.facade.snapshot import WorkerView

PANEL_MIN_WIDTH = 38    # a worker panel's narrowest (themes/tokentop.tcss)
PANEL_HEIGHT = 9        # a panel's figures, its KV grid and its frame


def line_columns(count: int, height: int) -> int:
    """Columns of worker lines so that they take at most about a third of the screen."""
    rows = max(3, height // 3 - 2)
    return max(1, -(-count // rows))


class WorkersRow(Horizontal):
    def __init__(self, workers: tuple[WorkerConfig, ...], **kwargs) -> None:
        super().__init__(**kwargs)
        self.configs = workers
        self.compact = False
        self.expanded: int | None = None       # in compact mode: the worker shown in full

    def compose(self) -> ComposeResult:
        with Grid(id="worker-lines", classes="panel") as lines:
            lines.border_title = "workers (e expands one)"
            for i, cfg in enumerate(self.configs):
                yield WorkerLine(i, cfg)
        for i, cfg in enumerate(self.configs):
            yield WorkerPanel(i, cfg)

    def on_mount(self) -> None:
        self.panels = list(self.query(WorkerPanel))
        self.lines = list(self.query(WorkerLine))
        self._grid = self.query_one("#worker-lines", Grid)
        self._arrange()

    # --- layout ---------------------------------------------------------------------------
    def fit(self, width: int, height: int) -> None:
        """Full panels when every one gets its narrowest width, else one line each."""
        compact = len(self.configs) * PANEL_MIN_WIDTH > width
        if compact != self.compact or self._screen_height != height:
            self.compact = compact
            self._screen_height = height
            if not compact:
                self.expanded = None
            self._arrange()

    _screen_height = 0

    def expand_next(self) -> int | None:
        """Show the next worker in full (after the last: none); only where lines are shown."""
        order = [None, *range(len(self.configs))]
        self.expand(order[(order.index(self.expanded) + 1) % len(order)])
        return self.expanded

    def expand(self, index: int | None) -> None:
        self.expanded = index
        self._arrange()

    def on_worker_line_pressed(self, event: WorkerLine.Pressed) -> None:
        self.expand(None if self.expanded == event.index else event.index)

    def _arrange(self) -> None:
        if not hasattr(self, "panels"):
            return
        self.set_class(self.compact, "-compact")
        self._grid.display = self.compact
        for panel in self.panels:
            panel.display = not self.compact or panel.index == self.expanded
        for line in self.lines:
            line.set_class(line.index == self.expanded, "-expanded")
        if not self.compact:
            self.styles.height = None          # the stylesheet's share of the screen
            return
        columns = line_columns(len(self.lines), self._screen_height)
        self._grid.styles.grid_size_columns = columns
        rows = -(-len(self.lines) // columns)
        self._grid.styles.height = rows + 2
        self.styles.height = max(rows + 2, PANEL_HEIGHT if self.expanded is not None else 0)

    # --- figures ----------------------------------------------------------------------------
    def show(self, views: dict[int, WorkerView], assembly: dict[str, tuple[int, int]],
             start_error: str | None) -> None:
        """Each worker's view, or while it loads its model file's assembly, or the start's failure."""
        for panel, line in zip(self.panels, self.lines):
            view = views.get(panel.index)
            loading = view is None or view.state in ("starting", "loading")
            done, total = assembly.get(panel.cfg.model, (0, 0))
            # the lines always (they are what the user sees in compact mode), a hidden panel never
            targets = [line] + ([panel] if panel.display else [])
            for target in targets:
                if loading and start_error:
                    target.show_failure(start_error)
                elif loading and done < total:
                    target.show_assembly(done, total)
                elif view is not None:
                    target.show_view(view)
