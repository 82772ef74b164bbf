"""The tokentop dashboard: TokentopApp and `run_dashboard(argv)` (`tokentop` with no subcommand).

The app owns one Engine. It starts it on a background thread so the screen appears at once
and shows model assembly and loading; then, five times a second, it takes one immutable
`engine.snapshot()` and hands the pieces to the panels, which update in place. Keys send
commands (submit, abort, policies, tracing); anything slow (bursts, trace export, shutdown)
runs on a daemon thread and reports back through a queue read by the same timer.
"""
from __future__ import annotations

import functools
import gc
import queue
import sys
import threading
from dataclasses import replace
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Callable, Iterable

import platformdirs
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal
from textual.markup import escape
from textual.screen import Screen
from textual.widgets import Footer

from app.burst_runner import BurstRun, BurstPlan
from app.bursts import default_prompts_dir, list_burst_files, load_burst
from app.cli import (EXIT_USAGE, build_dashboard_parser, check_dashboard_server_flags, engine_config_from,
                     serve_config_from, start_recording)
from app.flags import describe_error   # engine messages with their settings as flags
from app.screens.burst import BurstDialog, DEFAULTS
from app.screens.compare import CompareDialog, CompareResult, CompareSpec
from app.screens.detail import RequestDetail
from app.screens.help import HelpScreen
from app.screens.prompt import PromptDialog
from app.settings import load_settings, save_settings
from app.widgets.workers import WorkersRow
from app.widgets.charts import HistoryCharts, window_label
from app.widgets.event_log import EventLog
from app.widgets.fmt import fmt_rate, fmt_seconds, fmt_uptime, short_worker
from app.widgets.latency import LatencyPanel
from app.widgets.line import Line
from app.widgets.panel import Panel
from app.widgets.requests import RequestChosen, RequestsTable
from app.widgets.routing import RoutingPanel
from app.widgets.spec import SpecPanel
from app.widgets.timeline import TimelinePanel
from app.widgets.streams import StreamsPanel
from engine.config import ROUTER_POLICIES, SCHED_POLICIES, EngineConfig, SamplingParams
from engine.facade.engine import Engine
from engine.errors import TokentopError
from engine.facade.latency import WINDOWS as LATENCY_WINDOWS
from engine.facade.snapshot import EngineSnapshot
from themes import KV_DEFAULTS, STYLESHEET, THEMES

REFRESH_S = 0.2              # 5 Hz, as often as workers report their stats
SHUTDOWN_TIMEOUT_S = 2.0     # per worker join before the engine terminates it
SPEC_PANEL_MIN_WIDTH = 120   # terminal columns from which the speculation panel is shown
ROUTING_PANEL_MIN_WIDTH = 120   # ... and the routing panel (below, the latency panel has its place)
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


def reported(command: Callable) -> Callable:
    """A UI command whose failure becomes an error notification, never a traceback."""
    @functools.wraps(command)
    def run(self: "TokentopApp", *args):
        try:
            return command(self, *args)
        except Exception as exc:
            self.notify(describe_error(exc), severity="error", timeout=8)
    return run


def startup_burst(path: str) -> BurstPlan:
    """--burst-file: checked now (a bad file is a one-line error before anything loads);
    fired once every worker has started."""
    items = load_burst(path)
    return BurstPlan(path=Path(path), count=len(items), interval_ms=int(DEFAULTS["interval"]),
                     max_tokens=None, temperature=None)


def run_dashboard(argv: list[str]) -> int:
    args = build_dashboard_parser().parse_args(argv)
    try:
        check_dashboard_server_flags(args)
        burst = startup_burst(args.burst_file) if args.burst_file else None
        config = engine_config_from(args, default_mode="process")
        # the routing panel shows the cost router's estimates: every worker gets a speed
        # profile (cached after its first start-up; measured then, as a start-up stage)
        config = replace(config, workers=tuple(replace(w, calibrate=True) for w in config.workers))
        log = Path(platformdirs.user_log_dir("tokentop")) / "workers.log"
        app = TokentopApp(replace(config, worker_log=str(log)), startup_burst=burst)
        http = _start_http(app, args) if args.serve else None
        recorder = start_recording(app.engine, args.record)
    except (TokentopError, OSError) as exc:
        print(f"tokentop: error: {describe_error(exc)}", file=sys.stderr)
        return EXIT_USAGE
    try:
        app.run()
    finally:
        if http is not None:
            http.stop()
        if recorder is not None:
            recorder.close()
    app.wait_for_shutdown()
    return app.return_code or 0


def _start_http(app: "TokentopApp", args):
    """`--serve`: the HTTP API on the app's own engine, so its requests appear in the panels."""
    from engine.serve.server import HttpServer, parse_bind

    host, port = parse_bind(args.serve, default_host=args.host)
    http = HttpServer(app.engine, serve_config_from(args, host=host, port=port), quiet=True).start()
    app.serve_url = http.url
    app.engine.log("info", f"serving the OpenAI API on {http.url}/v1 (metrics at {http.url}/metrics)")
    return http


class TokentopApp(App[int]):
    TITLE = "tokentop"
    CSS_PATH = STYLESHEET
    BINDINGS = list(ACTIONS)

    def __init__(self, config: EngineConfig, *, settings_path: Path | None = None,
                 live: bool = True, startup_burst: BurstPlan | None = None) -> None:
        """live=False: the engine is not started and nothing refreshes by itself; the caller
        feeds show_snapshot() (snapshot tests, replays). startup_burst is fired once the
        engine is ready (--burst-file)."""
        super().__init__()
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

    # --- layout -------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Line(id="status")
        yield WorkersRow(self.config.workers, id="workers")
        with Horizontal(id="middle", classes="row"):
            yield Panel("requests", RequestsTable(id="requests"), TimelinePanel(id="timeline"),
                        id="requests-panel")
            yield Panel(self._latency_title(), LatencyPanel(id="latency"), id="latency-panel")
            yield Panel("routing", RoutingPanel(id="routing"), id="routing-panel")
        with Horizontal(id="bottom", classes="row"):
            yield Panel("streams", StreamsPanel(id="streams"), HistoryCharts(id="charts"), id="streams-panel")
            yield Panel("speculation", SpecPanel(id="spec"), id="spec-panel")
            yield Panel("log", EventLog(id="log"), id="log-panel")
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
        self._requests = self.query_one(RequestsTable)
        self._timeline = self.query_one(TimelinePanel)
        self._timeline.display = False
        self._requests_panel = self.query_one("#requests-panel")
        self._charts = self.query_one(HistoryCharts)
        self._charts.display = False
        self._streams_panel = self.query_one("#streams-panel")
        self._routing = self.query_one(RoutingPanel)
        self._streams = self.query_one(StreamsPanel)
        self._spec = self.query_one(SpecPanel)
        self._spec_panel = self.query_one("#spec-panel")
        self._latency = self.query_one(LatencyPanel)
        self._latency_panel = self.query_one("#latency-panel")
        self._routing_panel = self.query_one("#routing-panel")
        self._log = self.query_one(EventLog)
        self._status = self.query_one("#status", Line)
        self._requests.focus()
        self._show_status()
        if self.live:
            threading.Thread(target=self._start_engine, name="tokentop-start", daemon=True).start()
            self.set_interval(REFRESH_S, self.refresh_dashboard)

    # --- engine lifecycle (background threads) -----------------------------------------
    def _on_progress(self, name: str, done: int, total: int) -> None:
        self._assembly[name] = (done, total)   # read by the UI timer; one dict store is atomic

    def _start_engine(self) -> None:
        try:
            self.engine.start(wait=False)
        except Exception as exc:  # shown in the panels and as a notification, never as a traceback
            self._start_error = describe_error(exc)
            self._notices.put(("error", self._start_error))

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
        names = {w.index: w.name for w in snap.workers}
        if self._timeline.display:
            self._timeline.show_snapshot(snap)
        else:
            self._requests.show_requests(snap.requests, names)
        self._routing_panel.display = self.size.width >= ROUTING_PANEL_MIN_WIDTH
        if self._routing_panel.display:
            self._routing.show_decisions(snap.routing)
        if self._charts.display:
            self._charts.show_history(snap.history, names, snap.clock)
        else:
            self._streams.show_streams(snap.requests, names)
        # the speculation panel needs room: below SPEC_PANEL_MIN_WIDTH columns the request
        # table's spec column and the help carry it (z zooms a panel)
        self._spec_panel.display = self.size.width >= SPEC_PANEL_MIN_WIDTH
        if self._spec_panel.display:
            self._spec.show_spec(snap.workers, snap.requests, self.engine.spec_mode)
        self._latency.show_latency(snap.latency.get(self.latency_window), names)
        self._log.show_lines(snap.log)
        self._show_status()

    def _all_workers_up(self) -> bool:
        """Every worker has finished starting (ready, or failed), and one is ready."""
        snap = self.last_snapshot
        return (self.engine.ready and snap is not None and len(snap.workers) == len(self.config.workers)
                and all(w.state not in ("starting", "loading") for w in snap.workers))

    def _show_status(self) -> None:
        """The header. On a narrow terminal the fields drop out by priority (the higher the
        number, the sooner); the name and burst progress always stay."""
        snap = self.last_snapshot
        workers = snap.workers if snap else ()
        ready = sum(w.state == "ready" for w in workers)
        active = sum(r.state.live for r in snap.requests) if snap else 0
        # live: the engine's own (a key changes it before the next snapshot); else the picture's
        detail = self.engine.recorder.detail if self.live or snap is None else snap.trace_detail
        tracing = "[b $success]full[/]" if detail == "full" else detail
        parts = [(0, "[b $accent]tokentop[/]")]
        if snap is not None and snap.alerts:
            parts.append((0, alert_badge(snap.alerts)))
        for run in self.bursts:
            parts.append((0, f"burst {run.name} {run.submitted}/{run.spec.count}"))
        parts += [(1, f"{ready}/{len(self.config.workers)} ready"), (1, f"{active} active")]
        if snap is not None:
            live = [w for w in workers if w.state == "ready"]
            parts.append((2, f"decode {fmt_rate(sum(w.decode_tps for w in live))} tok/s"))
            parts.append((5, f"prefill {fmt_rate(sum(w.prefill_tps for w in live))} tok/s"))
            parts += self._latency_parts(snap)
        parts += [(3, f"router [b]{self.router_policy}[/]"), (3, f"sched [b]{self.scheduler_policy}[/]"),
                  (3, f"trace {tracing}")]
        if self.serve_url:
            parts.append((1, f"api {self.serve_url}"))
        if snap is not None and snap.uptime:
            parts.append((4, f"up {fmt_uptime(snap.uptime)}"))
        self._status.set_parts(parts, prefix=" ")

    def _latency_parts(self, snap: EngineSnapshot) -> list[tuple[int, str]]:
        """The latency panel's headline figures, for the header: p50 and p99 of TTFT and ITL,
        then e2e, over the panel's window."""
        view = snap.latency.get(self.latency_window)
        if view is None:
            return []
        parts = []
        for priority, metric, label in ((2, "ttft", "TTFT"), (3, "itl", "ITL"), (6, "e2e", "e2e")):
            s = view.summary(metric)
            if s.count:
                parts.append((priority, f"{label} p50 {fmt_seconds(s.p50)} p99 {fmt_seconds(s.p99)}"))
        return parts

    def _latency_title(self) -> str:
        return f"latency · {self.latency_window} (w)"

    def _finish_bursts(self) -> None:
        for run in [r for r in self.bursts if r.done]:
            self.bursts.remove(run)
            summary = run.summary()
            self.engine.log("info", summary.text())
            self.notify(summary.text(), title="burst finished", timeout=6)

    # --- actions --------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # Dashboard keys act only on the dashboard itself, not under a dialog.
        if action in DASHBOARD_ACTIONS and self.screen is not self.screen_stack[0]:
            return False
        return True

    def _engine_ready(self) -> bool:
        if self.engine.ready:
            return True
        self.notify(self._start_error or "the engine is still starting: wait until a worker is ready",
                    severity="warning")
        return False

    def _dialog(self, name: str, make: Callable[[], Screen]) -> str:
        """Dialogs are built once and reused: composing one costs about 100 ms of UI time."""
        if not self.is_screen_installed(name):
            self.install_screen(make(), name)
        return name

    @reported
    def action_burst(self) -> None:
        files = list_burst_files(default_prompts_dir())
        if not files:
            self.notify(f"no burst files (*.jsonl) in {default_prompts_dir()}", severity="error")
            return
        name = self._dialog("burst", lambda: BurstDialog(files))
        self.get_screen(name).set_files(files)
        self.push_screen(name, self.fire_burst)

    @reported
    def fire_burst(self, spec: BurstPlan | None) -> None:
        if spec is None or not self._engine_ready():
            return
        items = load_burst(spec.path)
        self.burst_count += 1
        if spec.max_tokens is not None and spec.temperature is not None:
            self.prompt_params = replace(self.prompt_params, max_tokens=spec.max_tokens,
                                         temperature=spec.temperature)
        name = f"{spec.path.stem}#{self.burst_count}"
        self.bursts.append(BurstRun(self.engine, spec, items, name).start())
        self.notify(f"burst {name}: {spec.count} requests from {spec.path}, one every {spec.interval_ms} ms")
        self._show_status()

    @reported
    def action_compare(self) -> None:
        if self._compare is not None and self._compare.is_alive():
            self.notify("a compare is still running; its result shows when both sides are done",
                        severity="warning")
            return
        files = list_burst_files(default_prompts_dir())
        if not files:
            self.notify(f"no burst files (*.jsonl) in {default_prompts_dir()}", severity="error")
            return
        self.push_screen(self._dialog("compare", lambda: CompareDialog(files)), self.start_compare)

    @reported
    def start_compare(self, spec: CompareSpec | None) -> None:
        if spec is None:
            return
        items = load_burst(spec.path)
        self._compare = threading.Thread(target=self._run_compare, args=(spec, items), name="tokentop-compare",
                                         daemon=True)
        self._compare.start()
        self.notify(f"compare {spec.path.name}: side A, then side B, each on a fresh engine…")

    def _run_compare(self, spec: CompareSpec, items) -> None:
        from engine.facade.compare import compare, format_report, write_report
        try:
            report = compare(self.config, items, spec.a, spec.b, burst=str(spec.path),
                             interval_s=spec.interval_ms / 1000,
                             progress=lambda text: self.engine.log("info", f"compare {text}"))
            path = write_report(report, None)
        except Exception as exc:  # reported in the UI, whatever it is
            self._notices.put(("error", f"compare failed: {describe_error(exc)}"))
            return
        self.engine.log("info", f"compare report written to {path}")
        try:
            self.call_from_thread(self.push_screen, CompareResult(format_report(report), path))
        except RuntimeError:      # the dashboard was closed meanwhile: the report file stays
            pass

    def action_prompt(self) -> None:
        self.push_screen(self._dialog("prompt", PromptDialog), self.submit_prompt)

    @reported
    def submit_prompt(self, text: str | None) -> None:
        if text is None or not self._engine_ready():
            return
        if self.engine.needs_remote_counts():
            # submit asks a remote's /tokenize for the prompt's length there (up to its timeout):
            # not on the UI's event loop
            threading.Thread(target=self._submit_off_loop, args=(text, self.prompt_params),
                             name="tokentop-prompt", daemon=True).start()
            return
        handle = self.engine.submit(text, params=self.prompt_params)
        self.notify(f"submitted {handle.id}")

    def _submit_off_loop(self, text: str, params) -> None:
        try:
            handle = self.engine.submit(text, params=params)
            self.call_from_thread(self.notify, f"submitted {handle.id}")
        except Exception as exc:  # noqa: BLE001 - shown like any UI command's failure
            self.call_from_thread(self.notify, describe_error(exc), severity="error", timeout=8)

    @reported
    def action_cycle_scheduler(self) -> None:
        policy = _next(SCHED_POLICIES, self.scheduler_policy)
        self.engine.set_scheduler_policy(policy)
        self.scheduler_policy = policy
        self._show_status()
        self.notify(f"scheduler policy: {policy}")

    @reported
    def action_cycle_router(self) -> None:
        policy = _next(ROUTER_POLICIES, self.router_policy)
        self.engine.set_router_policy(policy)
        self.router_policy = policy
        self._show_status()
        self.notify(f"router policy: {policy}")

    @reported
    def action_cycle_spec(self) -> None:
        modes = self.engine.spec_modes()
        current = self.engine.spec_mode or self.config.workers[0].speculate
        mode = _next(modes, current)
        self.engine.set_spec_mode(mode)
        self.notify(f"speculative decoding of new requests: {mode}")

    def action_expand_worker(self) -> None:
        row = self._workers_row
        if not row.compact:
            self.notify("every worker's panel is already shown in full", severity="information")
            return
        index = row.expand_next()
        if self.last_snapshot is not None:
            self.show_snapshot(self.last_snapshot)
        self.notify(f"worker {index} in full" if index is not None else "every worker on one line")

    def action_cycle_window(self) -> None:
        self.latency_window = _next([name for name, _ in LATENCY_WINDOWS], self.latency_window)
        self._latency_panel.border_title = self._latency_title()
        if self.last_snapshot is not None:
            self.show_snapshot(self.last_snapshot)

    def action_toggle_timeline(self) -> None:
        showing = not self._timeline.display
        self._timeline.display = showing
        self._requests.display = not showing
        (self._timeline if showing else self._requests).focus()
        self._title_requests()
        if self.last_snapshot is not None:
            self.show_snapshot(self.last_snapshot)

    def action_toggle_charts(self) -> None:
        showing = not self._charts.display
        self._charts.display = showing
        self._streams.display = not showing
        if showing:
            self._charts.focus()      # z zooms the focused panel: this one
        elif self._charts.has_focus:
            self._requests.focus()
        self._title_streams()
        if self.last_snapshot is not None:
            self.show_snapshot(self.last_snapshot)

    def action_cycle_chart_window(self) -> None:
        self._charts.cycle_window()
        self._title_streams()
        if self.last_snapshot is not None:
            self.show_snapshot(self.last_snapshot)

    def _title_streams(self) -> None:
        self._streams_panel.border_title = (f"history · {window_label(self._charts.window)} (m, h: streams)"
                                            if self._charts.display else "streams")

    def on_timeline_panel_changed(self, event: TimelinePanel.Changed) -> None:
        self._title_requests()

    def _title_requests(self) -> None:
        self._requests_panel.border_title = (self._timeline.title() if self._timeline.display
                                             else "requests")

    def _selected_request(self) -> str | None:
        """The request the table's, or the timeline's, cursor is on: whichever is shown."""
        return self._timeline.selected_id if self._timeline.display else self._requests.selected_id

    def action_abort(self) -> None:
        rid = self._selected_request()
        if rid is None:
            self.notify("no request selected: pick one in the request table", severity="warning")
        else:
            self.abort_request(rid)

    @reported
    def abort_request(self, rid: str) -> None:
        if self.engine.abort(rid):
            self.notify(f"aborting {rid}")
        else:
            self.notify(f"{rid} has already finished", severity="warning")

    def action_request_detail(self) -> None:
        rid = self._selected_request()
        if rid is None:
            self.notify("no request selected: pick one in the request table", severity="warning")
        else:
            self.push_screen(RequestDetail(rid))

    def on_request_chosen(self, event: RequestChosen) -> None:
        """A click on a request's row or lane: its detail, as Enter."""
        self.push_screen(RequestDetail(event.request_id))

    @reported
    def action_toggle_tracing(self) -> None:
        self.engine.set_tracing(not self.engine.tracing)
        self._show_status()
        self.notify(f"trace detail: {self.engine.recorder.detail}")

    @reported
    def action_export_trace(self) -> None:
        # the flight recorder has kept the last window all along: write it now
        threading.Thread(target=self._export_trace, name="tokentop-trace", daemon=True).start()
        self.notify("writing the trace…")

    def _export_trace(self) -> None:
        try:
            path = Path(self.engine.export_trace(self.config.trace_dir)).resolve()
        except Exception as exc:  # reported in the UI, whatever it is
            self._notices.put(("error", f"trace export failed: {describe_error(exc)}"))
            return
        self._notices.put(("information", f"trace written to {path}"))
        self.engine.log("info", f"trace written to {path}")

    def action_cycle_theme(self) -> None:
        self.theme = _next(THEME_CYCLE, self.theme)

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


def alert_badge(alerts) -> str:
    """The header's badge: the one alert active, or how many (the log says what each is)."""
    if len(alerts) == 1:
        a = alerts[0]
        return f"[b reverse $error] ⚠ {a.kind} {escape(short_worker(a.worker_name))} [/]"
    return f"[b reverse $error] ⚠ {len(alerts)} alerts [/]"


def _next(options: Iterable[str], current: str) -> str:
    options = tuple(options)
    return options[(options.index(current) + 1) % len(options)] if current in options else options[0]
