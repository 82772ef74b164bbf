"""A worker on one line, htop-style: state, running / waiting, a decode meter, a KV meter,
CPU and resident memory. Used when the full worker panels do not fit side by side.

The decode meter is scaled to the worker's own recent peak (its sparkline history), the KV
meter to its page pool (a remote worker: the KV usage scraped from its server). On a narrow
line the least important fields drop out whole (Line.set_parts); the name, the state and the
load always stay.
"""
from __future__ import annotations

from textual.events import Click
from textual.message import Message

from app.widgets.fmt import fmt_mib, fmt_rate, outside_markup, short_worker
from app.widgets.line import Line
from app.widgets.worker import STATE_STYLE
from engine.config import WorkerConfig
from engine.facade.snapshot import WorkerView

EIGHTHS = " ▏▎▍▌▋▊▉"


def meter(fraction: float, width: int) -> str:
    """A bar of `width` cells filled to `fraction`, in eighths of a cell."""
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    full, part = divmod(eighths, 8)
    return ("█" * full + (EIGHTHS[part] if part else "")).ljust(width)


def kv_style(usage: float) -> str:
    return "$error" if usage >= 0.95 else "$warning" if usage >= 0.8 else "$primary"


class WorkerLine(Line):
    """One worker's line; a click asks for its full panel (WorkerLine.Pressed)."""

    class Pressed(Message):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.index = index

    def __init__(self, index: int, cfg: WorkerConfig) -> None:
        super().__init__("", id=f"worker-line-{index}", classes="worker-line")
        self.index = index
        self.cfg = cfg
        self._head = f"[b]w{index} {outside_markup(short_worker(cfg.name or cfg.device))}[/]"
        self.show_text("starting", "waiting for the engine to start this worker…")

    def on_click(self, event: Click) -> None:
        self.post_message(self.Pressed(self.index))

    def show_text(self, state: str, text: str) -> None:
        style = STATE_STYLE.get(state, "$text")
        self.set_parts([(0, self._head), (0, f"[{style}]● {outside_markup(state)}[/]"),
                        (1, f"[{style}]{outside_markup(text)}[/]")], sep="  ")

    def show_assembly(self, done: int, total: int) -> None:
        self.show_text("loading", f"assembling the model file: {done / 2**20:.0f}/{total / 2**20:.0f} MiB")

    def show_failure(self, message: str) -> None:
        self.show_text("dead", message)

    def show_view(self, w: WorkerView) -> None:
        self.set_class(w.state in ("dead", "stopped"), "-dead")
        if w.state != "ready":
            self.show_text(w.state, w.message or w.state)
            return
        width = 10 if self.app.size.width >= 100 else 6     # meter cells
        peak = max((*w.decode_history, w.decode_tps), default=0.0)
        parts = [(0, self._head), (0, f"[{STATE_STYLE['ready']}]●[/]"),
                 (0, f"run {w.running}/{w.max_active} wait {w.waiting}"),
                 (1, f"dec [$secondary]{meter(w.decode_tps / peak if peak else 0.0, width)}[/]"
                     f"{fmt_rate(w.decode_tps):>5} tok/s")]
        usage = w.pages_used / w.pages_total if w.pages_total else w.kv_usage
        if usage is not None:
            parts.append((2, f"KV [{kv_style(usage)}]{meter(usage, width)}[/]{100 * usage:>4.0f}%"))
        if w.cpu_percent is not None:
            parts.append((3, f"CPU {w.cpu_percent:.0f}%"))
        if w.rss_bytes is not None:
            parts.append((4, f"RSS {fmt_mib(w.rss_bytes)}"))
        if w.simulated:
            parts.append((5, "[$warning]simulated[/]"))
        self.set_parts(parts, sep="  ")
