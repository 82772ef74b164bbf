"""The A/B compare dialog (`c`) and the screen with its side-by-side result.

The dialog takes a burst file and the two sides' settings (KEY=VALUE ..., as `tokentop compare
--a/--b` does), checks them, and returns a CompareSpec; the app runs it on fresh engines off
the UI thread (engine/facade/compare.py) and shows the report here when both sides are done.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.markup import escape
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static

from app.bursts import BurstFileError, load_burst
from engine.errors import ConfigError
from engine.facade.compare import parse_settings

DEFAULT_FILE = "single_flight_4.jsonl"
DEFAULT_A, DEFAULT_B = "single-flight=off", "single-flight=after-prefill"


@dataclass(frozen=True)
class CompareSpec:
    path: Path
    a: dict
    b: dict
    interval_ms: int


class CompareDialog(ModalScreen[CompareSpec | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, files: list[Path]) -> None:
        super().__init__()
        self.files = files

    def compose(self) -> ComposeResult:
        names = [p.name for p in self.files]
        initial = self.files[names.index(DEFAULT_FILE)] if DEFAULT_FILE in names else self.files[0]
        with Vertical(id="compare-dialog", classes="dialog"):
            yield Static("[b]A/B compare a burst[/b]", classes="dialog-title")
            with Grid(id="compare-fields"):
                yield Label("burst file")
                yield Select([(p.name, p) for p in self.files], value=initial, allow_blank=False,
                             id="compare-file", compact=True)
                yield Label("or a path")
                yield Input(placeholder="your own file, e.g. ~/prompts.jsonl", id="compare-path", compact=True)
                yield Label("A")
                yield Input(DEFAULT_A, id="compare-a", compact=True)
                yield Label("B")
                yield Input(DEFAULT_B, id="compare-b", compact=True)
                yield Label("interval ms")
                yield Input("0", id="compare-interval", type="integer", compact=True)
            yield Static("", id="compare-error", classes="dialog-error")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Run", variant="primary", id="run", compact=True)
                yield Button("Cancel", id="cancel", compact=True)
            yield Static("[$text-muted]KEY=VALUE ...: policy, router-policy, prefix-cache, single-flight, "
                         "speculate, spec-k, spec-tv-budget, max-active, worker. Each side runs on a fresh "
                         "engine beside this one (for quiet figures: tokentop compare). Enter runs · Esc "
                         "cancels[/]", classes="dialog-hint")

    def on_screen_resume(self) -> None:
        self.query_one("#compare-error", Static).update("")
        self.query_one("#compare-a", Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.run_compare()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "run":
            self.run_compare()
        else:
            self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)

    def run_compare(self) -> None:
        value = lambda wid: self.query_one(wid, Input).value  # noqa: E731
        typed = value("#compare-path").strip()
        path = Path(typed).expanduser() if typed else self.query_one("#compare-file", Select).value
        try:
            a = parse_settings(value("#compare-a").split(), "A")
            b = parse_settings(value("#compare-b").split(), "B")
            interval = int(value("#compare-interval") or "0")
            if not 0 <= interval <= 60_000:
                raise ValueError(f"interval must be between 0 and 60000 ms, got {interval}")
            load_burst(path, self.app.max_burst_requests)
        except (ValueError, ConfigError, BurstFileError) as exc:
            self.query_one("#compare-error", Static).update(escape(str(exc)))
            return
        self.dismiss(CompareSpec(path, a, b, interval))


class CompareResult(ModalScreen[None]):
    """The side-by-side table of a finished compare."""
    BINDINGS = [Binding("escape,q,c", "close", "Close")]

    def __init__(self, text: str, path: str) -> None:
        super().__init__()
        self.text = text
        self.path = path

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="compare-result", classes="dialog"):
            yield Static("[b]A/B compare[/b]", classes="dialog-title")
            yield Static(escape(self.text), id="compare-table")
            yield Static(f"[$text-muted]report: {escape(self.path)} · Esc closes[/]", classes="dialog-hint")

    def action_close(self) -> None:
        self.dismiss(None)
