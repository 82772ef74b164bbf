"""The burst dialog: which burst file, how many requests, how fast, how long, how random.

The file is a bundled sample (the list) or any JSONL file whose path is typed in the path
field, which wins when it is filled in. Enter in any field fires with what is shown; Escape
cancels. The dialog checks the fields and loads the file (so a mistake in it is shown here,
with its file:line, and the dialog stays open), then returns a BurstPlan; the app fires it.
The app reuses one dialog, so the fields keep the values of the last burst.
"""
from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.widgets import Input, Label

from app.burst_runner import BurstPlan
from app.bursts import BurstFileError, load_burst
from app.screens.burst_file import BurstFileDialog

DEFAULTS = {"count": "16", "interval": "100", "max_tokens": "64", "temperature": "0.0"}
DEFAULT_FILE = "mixed.jsonl"


def parse_spec(path: Path, count: str, interval: str, max_tokens: str, temperature: str) -> BurstPlan:
    """Check the fields; a ValueError carries a message for the user."""
    def number(text: str, name: str, kind, low: float, high: float):
        try:
            value = kind(text.strip())
        except ValueError:
            raise ValueError(f"{name} must be {'a whole number' if kind is int else 'a number'}, "
                             f"got {text!r}") from None
        if not low <= value <= high:
            raise ValueError(f"{name} must be between {low:g} and {high:g}, got {value:g}")
        return value

    return BurstPlan(path=path, count=number(count, "count", int, 1, 10_000),
                     interval_ms=number(interval, "interval", int, 0, 60_000),
                     max_tokens=number(max_tokens, "max tokens", int, 1, 32_768),
                     temperature=number(temperature, "temperature", float, 0.0, 5.0))


class BurstDialog(BurstFileDialog):
    PREFIX, DEFAULT_FILE, FIRST_FIELD = "burst", DEFAULT_FILE, "count"
    HEADING, SUBMIT, HINT = "Fire a burst", ("Fire", "fire"), "Enter fires · Esc cancels"

    def own_fields(self) -> ComposeResult:
        yield Label("count")
        yield Input(DEFAULTS["count"], id="burst-count", type="integer", compact=True)
        yield Label("interval ms")
        yield Input(DEFAULTS["interval"], id="burst-interval", type="integer", compact=True)
        yield Label("max tokens")
        yield Input(DEFAULTS["max_tokens"], id="burst-max-tokens", type="integer", compact=True)
        yield Label("temperature")
        yield Input(DEFAULTS["temperature"], id="burst-temperature", type="number", compact=True)

    def submit(self) -> None:
        try:
            spec = parse_spec(self.chosen_path(), self.field("count"), self.field("interval"),
                              self.field("max-tokens"), self.field("temperature"))
            load_burst(spec.path)          # its own messages name the file and line
        except (ValueError, BurstFileError) as exc:
            self.show_error(str(exc))
            return
        self.dismiss(spec)
