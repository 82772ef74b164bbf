"""The tokentop dashboard's UI: TokentopApp (`tokentop` with no subcommand; app/cli.py's
cmd_dashboard starts it).

The app owns one Engine. It starts it on a background thread so the screen appears at once
and shows model assembly and loading; then, five times a second, it takes one immutable
`engine.snapshot()` and hands it to the panels (app/panels.py), which update in place. The
view keys live here, the keys that act on the engine in app/commands.py; anything slow
(bursts, compare, trace export, shutdown) runs on a daemon thread and reports back through a
queue read by the same timer.
"""
from __future__ import annotations

import gc
import queue
import threading
from dataclasses import replace
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Callable, Iterable

from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer

from app.burst_runner import BurstPlan, BurstRun
from app.bursts import MAX_BURST_REQUESTS
from app.commands import EngineCommands, next_option
from app.flags import describe_error   # engine messages with their settings as flags
from app.header import header_parts
from app.jobs import in_background
from app.panels import PANELS, compose_panels, draw_panels
from app.screens.burst import DEFAULTS
from app.screens.detail import RequestDetail
from app.screens.help import HelpScreen
from app.settings import load_settings, save_settings
from app.widgets.cursor import RequestChosen
from app.widgets.line import Line
from app.widgets.panel import Frame, Panel
from app.widgets.timeline import TimelinePanel
from app.widgets.workers import WorkersRow
from engine.config import ROUTER_POLICIES, SCHED_POLICIES, EngineConfig, SamplingParams
from engine.facade.engine import Engine
from engine.facade.latency import WINDOWS as LATENCY_WINDOWS
from engine.facade.snapshot import EngineSnapshot
from engine.outside import visible
from themes import KV_DEFAULTS, STYLESHEET, THEMES

REFRESH_S = 0.2              # 5 Hz, as often as workers report their stats
SHUTDOWN_TIMEOUT_S = 2.0     # per worker join before the engine terminates it
FOOTER_PALETTE_MIN_WIDTH = 90    # below, the footer's keys need the palette's place (ctrl+p still opens it)
THEME_CYCLE = tuple(t.name for t in THEMES)
# Dashboard keys. The footer, the help screen and the command palette are generated from them.
ACTIONS = (
    Binding("b", "burst", "Burst", tooltip="Fire a burst of requests from a burst file (a sample or your own)"),
    Binding("n", "prompt", "Prompt", tooltip="Submit one prompt you type"),
    Binding("p", "cycle_scheduler", "Sched", tooltip=f"Cycle the scheduler policy ({', '.join(SCHED_POLICIES)})"),
    Binding("r", "cycle_router", "Router", tooltip=f"Cycle the router policy ({', '.join(ROUTER_POLICIES)})"),
    Binding("s", "cycle_spec", "Spec", tooltip="Cycle speculative decoding of new requests "
                                               "(off, ngram, suffix, draft when a draft model is loaded)"),
    Binding("w", "cycle_window", "Window", show=False, tooltip="Cycle the latency window: last 10 s, last 60 s, "
                                                     "the whole session"),
    Binding("e", "expand_worker", "Expand", show=False,
            tooltip="Where the workers are one line each: show the next one in full (after the last: none)"),
    Binding("x,delete", "abort", "Abort", tooltip="Abort the request selected in the request table"),
    Binding("g", "toggle_timeline", "Timeline", show=False,
            tooltip="Switch the request table and the request timeline (lanes of phases over time)"),
    Binding("h", "toggle_charts", "History", show=False,
            tooltip="Switch the token streams and the history charts (tok/s, running / waiting, KV usage)"),
    Binding("m", "cycle_chart_window", "Minutes", show=False,
            tooltip="Cycle the history charts' span: the last 1, 5 or 15 minutes"),
    Binding("enter", "request_detail", "Detail", show=False, tooltip="Show the selected request in full"),
    Binding("t", "export_trace", "Trace", tooltip="Write what the flight recorder kept (the last 120 s by "
                                                  "default, every worker) as one Perfetto trace"),
    Binding("T", "toggle_tracing", "Detail", show=False, tooltip="Switch trace detail: light (steps, counters, "
                                                                 "routing, request lifecycles) or full (+ per-layer "
                                                                 "scopes, NVTX on GPUs)"),
    Binding("c", "compare", "Compare", show=False, tooltip="A/B compare: run a burst under settings A, then B, "
                                                           "on fresh engines, and show both side by side"),
    Binding("d", "cycle_theme", "Theme", show=False, tooltip="Switch between the dark and light theme"),
    Binding("z", "zoom", "Zoom", show=False, tooltip="Zoom the focused panel to the full screen, or back"),
    Binding("question_mark", "help", "Help", tooltip="Show every key and what the panels mean"),
    Binding("q", "quit", "Quit", tooltip="Quit (stops the engine)"),
)
DASHBOARD_ACTIONS = {b.action for b in ACTIONS} - {"quit"}


class KeysFooter(Footer):
    """The footer; on a narrow terminal the keys take the command palette's place."""

    def on_resize(self) -> None:
        self.show_command_palette = self.size.width >= FOOTER_PALETTE_MIN_WIDTH


class TokentopApp(EngineCommands, App[int]):
    TITLE = "tokentop"
    CSS_PATH = STYLESHEET
    BINDINGS = list(ACTIONS)

    def __init__(self, config: EngineConfig, *, settings_path: Path | None = None,
                 live: bool = True, startup_burst: BurstPlan | None = None,
                 max_burst_requests: int = MAX_BURST_REQUESTS) -> None:
        """live=False: the engine is not started and nothing refreshes by itself; the caller
        feeds show_snapshot() (snapshot tests, replays). startup_burst is fired once the
        engine is ready (--burst-file); a burst file may hold max_burst_requests requests."""
        super().__init__()
        self.max_burst_requests = max_burst_requests
        self.startup_burst = startup_burst
        self.config = config
        self.settings_path = settings_path
        self.settings = load_settings(settings_path)
        self.live = live
        if live and config.worker_mode == "process":
            # Start multiprocessing's resource tracker while sys.stderr is still the real one:
            # inside the app it is a capture object whose fileno() is -1, and spawning the
            # tracker from there fails with "bad value(s) in fds_to_keep".
            resource_tracker.ensure_running()
        self.engine = Engine(config, progress=self._on_progress)
        self.scheduler_policy = config.workers[0].policy
        self.router_policy = config.router_policy
        self.last_snapshot: EngineSnapshot | None = None
        self.bursts: list[BurstRun] = []
        self.burst_count = 0
        self.prompt_params = SamplingParams(max_tokens=int(DEFAULTS["max_tokens"]),
                                            temperature=float(DEFAULTS["temperature"]))
        self._assembly: dict[str, tuple[int, int]] = {}
        self._start_error: str | None = None
        self._notices: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        self._shutdown_thread: threading.Thread | None = None
        self._refresh_error: str | None = None
        self.serve_url: str | None = None      # set by --serve
        self._compare: threading.Thread | None = None
        self.latency_window = LATENCY_WINDOWS[0][0]   # w cycles it
        self._heap_settled = False
        self.panels: dict[str, object] = {}     # panel id -> its widget, once mounted
        self.boxes: dict[str, Panel] = {}       # box name -> its titled box

    # --- layout -------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Line(id="status")
        yield WorkersRow(self.config.workers, id="workers")
        yield from compose_panels()
        yield KeysFooter(compact=True)

    def get_theme_variable_defaults(self) -> dict[str, str]:
        return {**super().get_theme_variable_defaults(), **KV_DEFAULTS}

    def on_mount(self) -> None:
        for theme in THEMES:
            self.register_theme(theme)
        self.theme = self.settings.theme if self.settings.theme in self.available_themes else THEME_CYCLE[0]
        self.theme_changed_signal.subscribe(self, self._remember_theme)
        # Widgets are looked up once: queries on the app search the top screen, a dialog included.
        self._workers_row = self.query_one(WorkersRow)
        self._status = self.query_one("#status", Line)
        self.panels = {p.id: self.query_one(f"#{p.id}") for p in PANELS}
        self.boxes = {p.box: self.query_one(f"#{p.box}-panel", Panel) for p in PANELS}
        self.boxes["latency"].border_title = self._latency_title()
        self.panels["requests"].focus()
        self._show_status()
        if self.live:
            in_background("start", self._start_engine)
            self.set_interval(REFRESH_S, self.refresh_dashboard)

    # --- engine lifecycle (background threads) -----------------------------------------
    def _on_progress(self, name: str, done: int, total: int) -> None:
        self._assembly[name] = (done, total)   # read by the UI timer; one dict store is atomic

    def _start_engine(self) -> None:
        try:
            self.engine.start(wait=False)
        except Exception as exc:  # shown in the panels and as a notification, never as a traceback
            self._start_error = describe_error(exc)
            self.post_notice("error", self._start_error)

    def post_notice(self, severity: str, text: str) -> None:
        """From any thread: a notification the next refresh shows."""
        self._notices.put((severity, text))

    def begin_shutdown(self) -> None:
        """Stop bursts and the engine on a daemon thread, so quitting never waits on a worker."""
        if self._shutdown_thread is not None:
            return
        for run in self.bursts:
            run.stop()
        self._shutdown_thread = threading.Thread(
            target=self.engine.shutdown, kwargs={"timeout": SHUTDOWN_TIMEOUT_S},
            name="tokentop-shutdown", daemon=True)
        self._shutdown_thread.start()

    def wait_for_shutdown(self, timeout: float = 10.0) -> None:
        """After the UI is gone: give the workers a moment to stop cleanly."""
        self.begin_shutdown()
        self._shutdown_thread.join(timeout)

    def on_unmount(self) -> None:
        self.begin_shutdown()
        if self._heap_settled:
            gc.unfreeze()

    def settle_heap(self) -> None:
        """Once the engine is up: what start-up built (the modules, the tokenizer, the widgets)
        stays for as long as the dashboard runs, so it is left out of the garbage collector's
        full passes (gc.freeze). Each of those walked all of it, stalling the frame it fell in;
        they now walk only what was made since. Undone on unmount."""
        if not self._heap_settled:
            gc.collect()
            gc.freeze()
            self._heap_settled = True

    # --- the 5 Hz refresh ---------------------------------------------------------------
    def refresh_dashboard(self) -> None:
        while not self._notices.empty():
            severity, text = self._notices.get()
            self.notify(text, severity=severity, timeout=8 if severity == "error" else 4)
        try:
            self._finish_bursts()
            if self.startup_burst is not None and self._all_workers_up():
                spec, self.startup_burst = self.startup_burst, None
                self.fire_burst(spec)
            self.show_snapshot(self.engine.snapshot())
            if not self._heap_settled and self._all_workers_up():
                self.settle_heap()
        except Exception as exc:  # keep the dashboard up; say it once, not five times a second
            if describe_error(exc) != self._refresh_error:
                self._refresh_error = describe_error(exc)
                self.notify(f"dashboard refresh failed: {self._refresh_error}", severity="error", timeout=8)

    def show_snapshot(self, snap: EngineSnapshot) -> None:
        self.last_snapshot = snap
        self._workers_row.fit(self.size.width, self.size.height)
        self._workers_row.show({w.index: w for w in snap.workers}, self._assembly, self._start_error)
        frame = Frame(snap, worker_names(snap), self.latency_window, self.engine.spec_mode)
        draw_panels(frame, self.panels, self.boxes, self.size.width)
        self._show_status()

    def _all_workers_up(self) -> bool:
        """Every worker has finished starting (ready, or failed), and one is ready."""
        snap = self.last_snapshot
        return (self.engine.ready and snap is not None and len(snap.workers) == len(self.config.workers)
                and all(w.state not in ("starting", "loading") for w in snap.workers))

    def _show_status(self) -> None:
        self._status.set_parts(header_parts(self), prefix=" ")

    def notify(self, message: str, *, title: str = "", severity="information", timeout: float | None = None,
               markup: bool = True) -> None:
        """Every notification as plain text: most quote something from outside (a request id,
        a file name, an error naming a value), which must neither move the cursor nor be markup."""
        super().notify(visible(message), title=visible(title), severity=severity, timeout=timeout, markup=False)

    def _latency_title(self) -> str:
        return f"latency · {self.latency_window} (w)"

    # --- actions --------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # Dashboard keys act only on the dashboard itself, not under a dialog.
        if action in DASHBOARD_ACTIONS and self.screen is not self.screen_stack[0]:
            return False
        return True

    def _dialog(self, name: str, make: Callable[[], Screen]) -> str:
        """Dialogs are built once and reused: composing one costs about 100 ms of UI time."""
        if not self.is_screen_installed(name):
            self.install_screen(make(), name)
        return name

    def action_expand_worker(self) -> None:
        row = self._workers_row
        if not row.compact:
            self.notify("every worker's panel is already shown in full", severity="information")
            return
        index = row.expand_next()
        self._redraw()
        self.notify(f"worker {index} in full" if index is not None else "every worker on one line")

    def action_cycle_window(self) -> None:
        self.latency_window = next_option([name for name, _ in LATENCY_WINDOWS], self.latency_window)
        self.boxes["latency"].border_title = self._latency_title()
        self._redraw()

    def action_toggle_timeline(self) -> None:
        self._swap("toggle_timeline")

    def action_toggle_charts(self) -> None:
        self._swap("toggle_charts")

    def action_cycle_chart_window(self) -> None:
        self.panels["charts"].cycle_window()
        self._retitle("streams")
        self._redraw()

    def _swap(self, action: str) -> None:
        """The panel this action's key swaps in takes its box's place from the one shown there,
        or gives it back; focus follows the one shown, so `z` zooms what is on screen."""
        spec = next(p for p in PANELS if p.key == action)
        box = spec.box
        panel, mate = self.panels[spec.id], next(self.panels[p.id] for p in PANELS
                                                 if p.box == box and p.id != spec.id)
        showing = not panel.display
        had_focus = panel.has_focus
        panel.display, mate.display = showing, not showing
        if showing:
            panel.focus()
        elif had_focus or mate is self.panels["requests"]:
            self.panels["requests"].focus()
        self._retitle(box)
        self._redraw()

    def _retitle(self, box: str) -> None:
        """A box's title: its shown panel's own box_title() where it has one, else its declared one."""
        shown = next(p for p in PANELS if p.box == box and self.panels[p.id].display)
        own = getattr(self.panels[shown.id], "box_title", None)
        self.boxes[box].border_title = own() if own is not None else shown.title

    def _redraw(self) -> None:
        if self.last_snapshot is not None:
            self.show_snapshot(self.last_snapshot)

    def on_timeline_panel_changed(self, event: TimelinePanel.Changed) -> None:
        self._retitle("requests")

    def action_request_detail(self) -> None:
        rid = self._selected_request()
        if rid is None:
            self.notify("no request selected: pick one in the request table", severity="warning")
        else:
            self.push_screen(RequestDetail(rid))

    def on_request_chosen(self, event: RequestChosen) -> None:
        """A click on a request's row or lane: its detail, as Enter."""
        self.push_screen(RequestDetail(event.request_id))

    def action_cycle_theme(self) -> None:
        self.theme = next_option(THEME_CYCLE, self.theme)

    def _remember_theme(self, theme) -> None:
        if theme.name == self.settings.theme:
            return    # the theme applied at start-up, or no change: nothing to write
        self.settings = replace(self.settings, theme=theme.name)
        try:
            save_settings(self.settings, self.settings_path)
        except OSError as exc:
            self.notify(f"could not remember the theme: {exc}", severity="warning")

    def action_zoom(self) -> None:
        screen = self.screen
        if screen.maximized is not None:
            screen.minimize()
        elif screen.focused is not None:
            screen.maximize(screen.focused)

    def key_display(self, binding: Binding) -> str:
        """'x,delete' -> 'x / del': every key of a binding, as the footer shows keys."""
        return " / ".join(self.get_key_display(replace(binding, key=k)) for k in binding.key.split(","))

    def action_help(self) -> None:
        self.push_screen(self._dialog("help", lambda: HelpScreen([(self.key_display(b), b.tooltip)
                                                                   for b in ACTIONS])))

    async def action_quit(self) -> None:
        self.begin_shutdown()
        self.exit(0)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for binding in ACTIONS:
            if binding.action != "quit":
                yield SystemCommand(f"{binding.description} ({self.key_display(binding)})",
                                    binding.tooltip, lambda a=binding.action: self.run_action(a))


def worker_names(snap: EngineSnapshot) -> dict[int, str]:
    """Each worker's name as the panels show it: a replayed or watched one is outside text."""
    return {w.index: visible(w.name) for w in snap.workers}
