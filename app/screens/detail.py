"""One request in full: where it runs, its numbers, how it ended, its sampling settings, its
prompt and the last part of its text, refreshed while it runs."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from app.widgets.fmt import fmt_seconds, outside_markup
from engine.config import SamplingParams
from engine.facade.snapshot import RequestView

REFRESH_S = 0.2
PROMPT_CHARS = 1200        # the prompt's head shown; a long one ends with "…"
FINISH_WORDS = {"stop": "stop (end of text or a stop string)", "length": "length (max tokens reached)",
                "abort": "aborted", "error": "error"}


def sampling_text(p: SamplingParams | None) -> str:
    """The settings that differ from plain greedy decoding, plus max tokens and temperature."""
    if p is None:
        return "-"
    words = [f"temperature {p.temperature:g}" + (" (greedy)" if p.temperature == 0 else "")]
    default = SamplingParams()
    for name in ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "seed", "stop", "ignore_eos"):
        value = getattr(p, name)
        if value != getattr(default, name):
            words.append(f"{name.replace('_', ' ')} {value!r}" if name == "stop" else f"{name.replace('_', ' ')} {value}")
    return ", ".join(words)


PROMPT_SOURCE = {"remote": " (counted by the remote's /tokenize)",
                 "estimate": " (estimate: the local tokenizer's count; the remote serves another model)"}


def detail_markup(r: RequestView, worker_name: str | None = None) -> str:
    worker = "-" if r.worker is None else (worker_name or f"w{r.worker}")
    rows = [("state", r.state), ("worker", worker),
            ("burst", r.burst or "-"), ("prompt tokens", str(r.prompt_tokens) + PROMPT_SOURCE.get(r.prompt_source, "")),
            ("cached tokens", str(r.cached_tokens)), ("output tokens", f"{r.output_tokens} of {r.max_tokens}"),
            ("sampling", sampling_text(r.params)),
            ("queued for", fmt_seconds(r.queue_time)), ("TTFT", fmt_seconds(r.ttft)),
            ("ITL (mean)", fmt_seconds(r.itl_mean)), ("end to end", fmt_seconds(r.e2e))]
    if r.finish_reason and r.finish_reason != "error":
        rows.append(("finished", FINISH_WORDS.get(r.finish_reason, r.finish_reason)))
    if r.notice:
        rows.append(("note", r.notice))
    lines = [f"  [$text-muted]{name:<14}[/] {outside_markup(value)}" for name, value in rows]
    if r.error:
        lines.append(f"  [$text-muted]{'error':<14}[/] [$error]{outside_markup(r.error)}[/]")
    return "\n".join(lines)


def prompt_markup(r: RequestView) -> str:
    prompt = r.prompt if len(r.prompt) <= PROMPT_CHARS else r.prompt[:PROMPT_CHARS] + "…"
    return "[b]prompt[/b]\n" + (outside_markup(prompt, multiline=True) or "[$text-muted](not known)[/]")


class RequestDetail(ModalScreen[None]):
    BINDINGS = [Binding("escape,enter,q", "close", "Close"),
                Binding("x,delete", "abort", "Abort")]

    def __init__(self, request_id: str) -> None:
        super().__init__()
        self.request_id = request_id
        self._shown: RequestView | None = None

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="detail-dialog", classes="dialog"):
            yield Static(f"[b]request {outside_markup(self.request_id)}[/b]", classes="dialog-title")
            yield Static("", id="detail-fields")
            yield Static("", id="detail-prompt")
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
        names = {w.index: w.name for w in snap.workers}
        if self._shown is None or view.prompt != self._shown.prompt:
            self.query_one("#detail-prompt", Static).update(prompt_markup(view))
        self._shown = view
        self.query_one("#detail-fields", Static).update(detail_markup(view, names.get(view.worker)))
        self.query_one("#detail-text", Static).update(
            "[b]output[/b]\n" + (outside_markup(view.text_tail, multiline=True) or "[$text-muted](no text yet)[/]"))

    def action_abort(self) -> None:
        self.app.abort_request(self.request_id)

    def action_close(self) -> None:
        self.dismiss(None)
