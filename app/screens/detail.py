"""One request in full: its numbers and the last part of its text, refreshed while it runs."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.markup import escape
from textual.screen import ModalScreen
from textual.widgets import Static

from app.widgets.fmt import fmt_seconds
from engine.snapshot import RequestView

REFRESH_S = 0.2


def detail_markup(r: RequestView) -> str:
    rows = [("state", r.state), ("worker", "-" if r.worker is None else str(r.worker)),
            ("burst", r.burst or "-"), ("prompt tokens", str(r.prompt_tokens)),
            ("cached tokens", str(r.cached_tokens)), ("output tokens", f"{r.output_tokens} of {r.max_tokens}"),
            ("queued for", fmt_seconds(r.queue_time)), ("TTFT", fmt_seconds(r.ttft)),
            ("ITL (mean)", fmt_seconds(r.itl_mean)), ("end to end", fmt_seconds(r.e2e))]
    lines = [f"  [$text-muted]{name:<14}[/] {escape(value)}" for name, value in rows]
    if r.error:
        lines.append(f"  [$text-muted]{'error':<14}[/] [$error]{escape(r.error)}[/]")
    return "\n".join(lines)


class RequestDetail(ModalScreen[None]):
    BINDINGS = [Binding("escape,enter,q", "close", "Close"),
                Binding("x,delete", "abort", "Abort")]

    def __init__(self, request_id: str) -> None:
        super().__init__()
        self.request_id = request_id
        self._shown: RequestView | None = None

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="detail-dialog", classes="dialog"):
            yield Static(f"[b]request {escape(self.request_id)}[/b]", classes="dialog-title")
            yield Static("", id="detail-fields")
            yield Static("", id="detail-text")
            yield Static("[$text-muted]x aborts · Esc, Enter or q closes[/]", classes="dialog-hint")

    def on_mount(self) -> None:
        self.show_latest()
        self.set_interval(REFRESH_S, self.show_latest)

    def show_latest(self) -> None:
        snap = self.app.last_snapshot
        view = next((r for r in snap.requests if r.id == self.request_id), None) if snap else None
        if view is None or view == self._shown:
            return
        self._shown = view
        self.query_one("#detail-fields", Static).update(detail_markup(view))
        self.query_one("#detail-text", Static).update(escape(view.text_tail) or "[$text-muted](no text yet)[/]")

    def action_abort(self) -> None:
        self.app.abort_request(self.request_id)

    def action_close(self) -> None:
        self.dismiss(None)
