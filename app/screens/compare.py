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
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Static

from app.bursts import BurstFileError, load_burst
from app.widgets.fmt import outside_markup
from app.screens.burst_file import BurstFileDialog
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


class CompareDialog(BurstFileDialog):
    PREFIX, DEFAULT_FILE, FIRST_FIELD = "compare", DEFAULT_FILE, "a"
    HEADING, SUBMIT = "A/B compare a burst", ("Run", "run")
    HINT = ("KEY=VALUE ...: policy, router-policy, prefix-cache, single-flight, speculate, spec-k, spec-tv-budget, "
            "max-active, worker. Each side runs on a fresh engine beside this one (for quiet figures: tokentop "
            "compare). Enter runs · Esc cancels")

    def own_fields(self) -> ComposeResult:
        yield Label("A")
        yield Input(DEFAULT_A, id="compare-a", compact=True)
        yield Label("B")
        yield Input(DEFAULT_B, id="compare-b", compact=True)
        yield Label("interval ms")
        yield Input("0", id="compare-interval", type="integer", compact=True)

    def submit(self) -> None:
        path = self.chosen_path()
        try:
            a = parse_settings(self.field("a").split(), "A")
            b = parse_settings(self.field("b").split(), "B")
            interval = int(self.field("interval") or "0")
            if not 0 <= interval <= 60_000:
                raise ValueError(f"interval must be between 0 and 60000 ms, got {interval}")
            load_burst(path)
        except (ValueError, ConfigError, BurstFileError) as exc:
            self.show_error(str(exc))
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
            yield Static(outside_markup(self.text, multiline=True), id="compare-table")
            yield Static(f"[$text-muted]report: {outside_markup(self.path)} · Esc closes[/]", classes="dialog-hint")

    def action_close(self) -> None:
        self.dismiss(None)
