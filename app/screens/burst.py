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
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.markup import escape
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static

from app.burst_runner import BurstPlan
from app.bursts import BurstFileError, load_burst

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


class BurstDialog(ModalScreen[BurstPlan | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, files: list[Path]) -> None:
        super().__init__()
        self.files = files

    def compose(self) -> ComposeResult:
        names = [p.name for p in self.files]
        initial = self.files[names.index(DEFAULT_FILE)] if DEFAULT_FILE in names else self.files[0]
        with Vertical(id="burst-dialog", classes="dialog"):
            yield Static("[b]Fire a burst[/b]", classes="dialog-title")
            with Grid(id="burst-fields"):
                yield Label("burst file")
                yield Select([(p.name, p) for p in self.files], value=initial, allow_blank=False,
                             id="burst-file", compact=True)
                yield Label("or a path")
                yield Input(placeholder="your own file, e.g. ~/prompts.jsonl", id="burst-path",
                            compact=True)
                yield Label("count")
                yield Input(DEFAULTS["count"], id="burst-count", type="integer", compact=True)
                yield Label("interval ms")
                yield Input(DEFAULTS["interval"], id="burst-interval", type="integer", compact=True)
                yield Label("max tokens")
                yield Input(DEFAULTS["max_tokens"], id="burst-max-tokens", type="integer", compact=True)
                yield Label("temperature")
                yield Input(DEFAULTS["temperature"], id="burst-temperature", type="number", compact=True)
            yield Static("", id="burst-error", classes="dialog-error")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Fire", variant="primary", id="fire", compact=True)
                yield Button("Cancel", id="cancel", compact=True)
            yield Static("[$text-muted]Enter fires · Esc cancels[/]", classes="dialog-hint")

    def set_files(self, files: list[Path]) -> None:
        """The dialog is reused: pick up burst files added since it was built."""
        if files != self.files:
            self.files = files
            self.query_one("#burst-file", Select).set_options((p.name, p) for p in files)

    def on_screen_resume(self) -> None:
        self.query_one("#burst-error", Static).update("")
        self.query_one("#burst-count", Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.fire()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "fire":
            self.fire()
        else:
            self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)

    def chosen_path(self) -> Path:
        typed = self.query_one("#burst-path", Input).value.strip()
        return Path(typed).expanduser() if typed else self.query_one("#burst-file", Select).value

    def fire(self) -> None:
        value = lambda wid: self.query_one(wid, Input).value  # noqa: E731
        try:
            spec = parse_spec(self.chosen_path(), value("#burst-count"),
                              value("#burst-interval"), value("#burst-max-tokens"),
                              value("#burst-temperature"))
            load_burst(spec.path, self.app.max_burst_requests)   # its messages name the file and line
        except (ValueError, BurstFileError) as exc:
            self.query_one("#burst-error", Static).update(escape(str(exc)))
            return
        self.dismiss(spec)
