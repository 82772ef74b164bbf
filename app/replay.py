"""`tokentop replay FILE`: the dashboard, read-only, fed by a recording instead of an engine.

The same TokentopApp and panels (live=False: no engine runs); a timer moves the position
along the recording at the chosen speed and shows the frame at or before it, so a position
always shows the same frame. Keys: space pauses, ← → seek 5 s, , . step one frame, + −
change the speed; the view keys (Enter, g timeline, h history charts, m their span, w latency
window, e worker panels, z, d, ?, q) work as live, the engine's do not.
"""
from __future__ import annotations

import time
from typing import Iterable

from textual.app import ComposeResult, SystemCommand
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer

from app.main import ACTIONS, DASHBOARD_ACTIONS, TokentopApp
from app.screens.help import HelpScreen
from app.widgets.fmt import outside_markup
from app.widgets.line import Line
from engine.config import EngineConfig, WorkerConfig
from engine.facade.snapshot_file import Recording

TICK_S = 0.05
SEEK_S = 5.0
SPEEDS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
BAR_CELLS = 30
# what still works on a recording: looking, not acting on an engine
VIEW_ACTIONS = {"request_detail", "cycle_theme", "zoom", "help", "toggle_timeline", "toggle_charts",
                "cycle_chart_window", "cycle_window", "expand_worker"}
REPLAY_KEYS = (
    Binding("space", "toggle_pause", "Pause", priority=True, tooltip="Pause or play the recording"),
    Binding("left", "seek(-5)", "−5 s", priority=True, tooltip=f"Back {SEEK_S:.0f} seconds"),
    Binding("right", "seek(5)", "+5 s", priority=True, tooltip=f"Forward {SEEK_S:.0f} seconds"),
    Binding("comma", "step(-1)", "Frame", show=False, tooltip="One frame back (pauses)"),
    Binding("full_stop", "step(1)", "Frame", show=False, tooltip="One frame on (pauses)"),
    Binding("plus,equals_sign", "speed(1)", "Faster", tooltip="Play faster (up to 16×)"),
    Binding("minus", "speed(-1)", "Slower", tooltip="Play slower (down to ¼×)"),
)
REPLAY_ACTIONS = {b.action.split("(")[0] for b in REPLAY_KEYS}


def fmt_position(seconds: float) -> str:
    minutes, rest = divmod(max(0.0, seconds), 60)
    return f"{int(minutes)}:{rest:04.1f}"


def position_bar(position: float, duration: float, cells: int = BAR_CELLS) -> str:
    filled = round(cells * position / duration) if duration > 0 else cells
    return "━" * filled + "─" * (cells - filled)


class ReplayApp(TokentopApp):
    BINDINGS = list(REPLAY_KEYS)

    def __init__(self, recording: Recording, *, settings_path=None, position: float = 0.0,
                 paused: bool = False, speed: float = 1.0) -> None:
        workers = recording.workers or (WorkerConfig(),)
        super().__init__(EngineConfig(workers=workers, worker_mode="thread"), settings_path=settings_path,
                         live=False)
        self.recording = recording
        self.position = round(min(max(position, 0.0), recording.duration), 3)
        self.paused = paused
        self.speed = speed if speed in SPEEDS else 1.0
        self.shown_index = -1
        self._last_tick = time.monotonic()

    def compose(self) -> ComposeResult:
        for widget in super().compose():
            if isinstance(widget, Footer):
                yield Line(id="replay-bar")
            yield widget

    def on_mount(self) -> None:
        super().on_mount()
        self._bar = self.query_one("#replay-bar", Line)
        self.panels["timeline"].pausable = False     # space pauses the recording instead
        self.panels["charts"].every_frame = True     # a frame's charts never lag its position by a column
        self.show_position()
        self._last_tick = time.monotonic()
        self.set_interval(TICK_S, self._tick)
        self.call_after_refresh(self.redraw)

    def on_resize(self) -> None:
        self.call_after_refresh(self.redraw)

    def redraw(self) -> None:
        """Show the frame again once the panels know their size (the KV grid's caption says
        how many pages a cell holds): paused, nothing else would redraw it."""
        self.shown_index = -1
        self.show_position()

    # --- the clock ------------------------------------------------------------------------
    def _tick(self) -> None:
        now = time.monotonic()
        elapsed, self._last_tick = now - self._last_tick, now
        if not self.paused:
            self.position = self._clamp(self.position + elapsed * self.speed)
            if self.position >= self.recording.duration:
                self.paused = True          # the end: stay on the last frame
        self.show_position()

    def show_position(self) -> None:
        """Show the frame at the position (the last one at or before it) and the bar."""
        index = self.recording.index_at(self.position)
        if index != self.shown_index:
            snap, spec_mode = self.recording.frame(index)
            self.engine.spec_mode = spec_mode
            self.router_policy = snap.router_policy
            if snap.workers:
                self.scheduler_policy = snap.workers[0].policy
            self.show_snapshot(snap)
            self.shown_index = index
        rec = self.recording
        state = "[b]❚❚[/]" if self.paused else "[b $success]▶[/]"
        speed = f"{self.speed:g}×"
        self._bar.set_parts([
            (0, f"{state} {fmt_position(self.position)} / {fmt_position(rec.duration)}"),
            (1, f"[$accent]{position_bar(self.position, rec.duration)}[/]"),
            (0, speed),
            (2, f"frame {index + 1}/{len(rec)}"),
            (3, f"replay of {outside_markup(rec.path.rsplit('/', 1)[-1])} (read-only)")], prefix=" ")

    # --- keys -----------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in DASHBOARD_ACTIONS and action not in VIEW_ACTIONS:
            return False                    # they act on an engine; a recording has none
        if action in REPLAY_ACTIONS and self.screen is not self.screen_stack[0]:
            return False
        return super().check_action(action, parameters)

    def action_toggle_pause(self) -> None:
        if self.paused and self.position >= self.recording.duration:
            self.position = 0.0             # play again from the start
        self.paused = not self.paused
        self.show_position()

    def action_seek(self, seconds: float) -> None:
        self.position = self._clamp(self.position + seconds)
        self.show_position()

    def _clamp(self, position: float) -> float:
        # in whole milliseconds, as the frames' times are: 0.4 + 5 - 5 is 0.4 again, the same frame
        return round(min(max(position, 0.0), self.recording.duration), 3)

    def action_step(self, frames: int) -> None:
        times = self.recording.times
        index = min(max(self.recording.index_at(self.position) + frames, 0), len(times) - 1)
        self.paused = True
        self.position = times[index]
        self.show_position()

    def action_speed(self, direction: int) -> None:
        at = SPEEDS.index(self.speed)
        self.speed = SPEEDS[min(max(at + direction, 0), len(SPEEDS) - 1)]
        self.show_position()

    def _keys(self) -> list[Binding]:
        return list(REPLAY_KEYS) + [b for b in ACTIONS if b.action in VIEW_ACTIONS or b.action == "quit"]

    def action_help(self) -> None:
        self.push_screen(self._dialog("help", lambda: HelpScreen([(self.key_display(b), b.tooltip)
                                                                   for b in self._keys()])))

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        for command in super().get_system_commands(screen):
            if not any(command.title.startswith(f"{b.description} (") for b in ACTIONS
                       if b.action not in VIEW_ACTIONS and b.action != "quit"):
                yield command
