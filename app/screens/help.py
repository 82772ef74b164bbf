"""The help screen: every key (from the app's own bindings, so it cannot drift) and a legend."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.markup import escape
from textual.screen import ModalScreen
from textual.widgets import Static

from app.widgets.kv_grid import FREE, GLYPHS, STATE_NAMES

PANELS = """\
[b]Panels[/b]
  header    workers ready, requests active, throughput, latency p50 / p99;
            [b reverse $error] ⚠ [/] the alerts active now: stall, kv-pressure, imbalance,
            worker-dead, remote-down (each logged once when it starts)
  workers   per worker: state, running / waiting, CPU% (100 = one core),
            resident memory, prefill / decode tok/s (history and profiled
            rate), KV page grid; a dead worker is greyed, its figures cleared;
            too many for their panels: one line each (decode meter scaled
            to its recent peak, KV meter), e shows one in full
  requests  what the engine remembers, newest first; the cursor follows
            the newest live request until you move it (↑ ↓); end: the
            finish reason or the error
  timeline  (g) one lane per request, newest on top, over the last 30 s
            (+ - zoom, space pauses): · queued  ~ waiting-on-leader
            ▒ prefill  █ decode  ░ preempted  ▓ a prefill chunk or a
            verify round ended there  ✓ finished  ⊘ aborted  ✗ error
  latency   p50 / p95 / p99 and count of TTFT, ITL (each request's mean
            gap between tokens), e2e and queue time over the last 10 s,
            60 s or the session (w), from the engine's request records;
            a log-scale histogram per metric; each worker's p99
  routing   recent decisions, newest first (from 120 columns): what the
            policy compared (cost: estimated seconds; round-robin compares
            nothing), then the load it counted; [$success]✓[/] on the chosen one
  streams   live text of the active requests, one colour per request
  history   (h, in the streams' place) decode and prefill tok/s, running
            and waiting (dotted), KV usage per worker over the last 1, 5
            or 15 minutes (m); z zooms them to the full screen
  log       errors, preemptions, worker deaths, policy changes, bursts
  mouse     a click on a request's row or lane opens it (as Enter), on a
            panel's title zooms the panel (as z; again or Esc: back), on a
            worker's line shows that worker in full"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "close", "Close")]

    def __init__(self, keys: list[tuple[str, str]]) -> None:
        super().__init__()
        self.keys = keys

    def compose(self) -> ComposeResult:
        width = max(len(k) for k, _ in self.keys)
        keys = "\n".join(f"  [b $accent]{escape(k):<{width}}[/]  {escape(d)}" for k, d in self.keys)
        legend = "  ".join(f"[{'$text-muted' if s == FREE else '$kv-' + STATE_NAMES[s]}]{g}[/] {STATE_NAMES[s]}"
                           for s, g in GLYPHS.items())
        with VerticalScroll(id="help-dialog", classes="dialog"):
            yield Static("[b]tokentop: keys[/b]  (also in the command palette, ctrl+p)", classes="dialog-title")
            yield Static(keys)
            yield Static(PANELS)
            yield Static(f"[b]KV grid[/b]  {legend}\n  with many pages, one cell stands for several "
                         "and shows\n  the most notable state among them")
            yield Static("[$text-muted]Esc, ? or q closes[/]", classes="dialog-hint")

    def action_close(self) -> None:
        self.dismiss(None)
