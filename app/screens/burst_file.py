"""The dialog shape the burst and compare dialogs share: a burst file picked from the bundled
samples or typed as a path (which wins when filled in), an error line, Enter submits, Escape
cancels. The app reuses one dialog of each kind, so the fields keep the last values.
"""
from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static

from app.widgets.fmt import outside_markup


class BurstFileDialog(ModalScreen):
    """A subclass names its widgets' id prefix, its title, submit button and hint, its default
    sample and the field focused on opening; it yields its own fields and implements submit()."""
    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    PREFIX = ""
    HEADING = ""
    SUBMIT = ("", "")               # the button's label and id
    HINT = ""
    DEFAULT_FILE = ""
    FIRST_FIELD = ""

    def __init__(self, files: list[Path]) -> None:
        super().__init__()
        self.files = files

    def compose(self) -> ComposeResult:
        with Vertical(id=f"{self.PREFIX}-dialog", classes="dialog"):
            yield Static(f"[b]{self.HEADING}[/b]", classes="dialog-title")
            with Grid(id=f"{self.PREFIX}-fields"):
                yield from self.file_fields()
                yield from self.own_fields()
            yield Static("", id=f"{self.PREFIX}-error", classes="dialog-error")
            with Horizontal(classes="dialog-buttons"):
                yield Button(self.SUBMIT[0], variant="primary", id=self.SUBMIT[1], compact=True)
                yield Button("Cancel", id="cancel", compact=True)
            yield Static(f"[$text-muted]{self.HINT}[/]", classes="dialog-hint")

    def own_fields(self) -> ComposeResult:
        raise NotImplementedError

    def file_fields(self) -> ComposeResult:
        names = [p.name for p in self.files]
        initial = self.files[names.index(self.DEFAULT_FILE)] if self.DEFAULT_FILE in names else self.files[0]
        yield Label("burst file")
        yield Select([(outside_markup(p.name), p) for p in self.files], value=initial, allow_blank=False,
                     id=f"{self.PREFIX}-file", compact=True)
        yield Label("or a path")
        yield Input(placeholder="your own file, e.g. ~/prompts.jsonl", id=f"{self.PREFIX}-path", compact=True)

    def set_files(self, files: list[Path]) -> None:
        """The dialog is reused: pick up burst files added since it was built."""
        if files != self.files:
            self.files = files
            self.query_one(f"#{self.PREFIX}-file", Select).set_options((outside_markup(p.name), p) for p in files)

    def chosen_path(self) -> Path:
        typed = self.field("path").strip()
        return Path(typed).expanduser() if typed else self.query_one(f"#{self.PREFIX}-file", Select).value

    def field(self, name: str) -> str:
        return self.query_one(f"#{self.PREFIX}-{name}", Input).value

    def show_error(self, text: str) -> None:
        self.query_one(f"#{self.PREFIX}-error", Static).update(outside_markup(text))

    def submit(self) -> None:
        raise NotImplementedError

    def on_screen_resume(self) -> None:
        self.show_error("")
        self.query_one(f"#{self.PREFIX}-{self.FIRST_FIELD}", Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.submit()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "cancel":
            self.dismiss(None)
        else:
            self.submit()

    def action_cancel(self) -> None:
        self.dismiss(None)
