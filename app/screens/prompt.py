"""Type one prompt and submit it (Enter); Escape cancels."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static


class PromptDialog(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def compose(self) -> ComposeResult:
        with Vertical(id="prompt-dialog", classes="dialog"):
            yield Static("[b]Submit one prompt[/b]", classes="dialog-title")
            yield Input(placeholder="e.g. Write a haiku about caches", id="prompt-text", compact=True)
            yield Static("[$text-muted]Enter submits (max tokens and temperature as in the last "
                         "burst dialog) · Esc cancels[/]", classes="dialog-hint")

    def on_screen_resume(self) -> None:
        # The app reuses this dialog: start from an empty prompt each time.
        prompt = self.query_one("#prompt-text", Input)
        prompt.value = ""
        prompt.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value)

    def action_cancel(self) -> None:
        self.dismiss(None)
