"""Speculative decoding at a glance: per worker, the acceptance rate over time, the mean
accepted length, acceptance by draft position (bars), and each speculating request's k.

Acceptance is accepted draft tokens / draft tokens verified; the mean accepted length is
vLLM's (tokens emitted per verify round: 1 + accepted / rounds); position i's bar is the
share of rounds that drafted an i-th token and had it accepted. The gain is the measured
tok/s of the steps with speculating requests over the worker's cost-model estimate of the
same steps without drafts.
"""
from __future__ import annotations

from textual.containers import VerticalScroll
from textual.widgets import Static

from app.widgets.fmt import outside_markup, short_worker
from app.widgets.rate_sparkline import spark_bars
from app.widgets.panel import PanelSpec
from engine.facade.snapshot import LIVE_STATES, RequestView, WorkerView

BAR_WIDTH = 12
MAX_POSITIONS = 8
LIVE = LIVE_STATES


def pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.0f}%"


def bar(x: float, width: int = BAR_WIDTH) -> str:
    eighths = round(max(0.0, min(1.0, x)) * width * 8)
    full, part = divmod(eighths, 8)
    return ("█" * full + (" ▏▎▍▌▋▊▉"[part] if part else "")).ljust(width)


def worker_lines(w: WorkerView, width: int) -> list[str]:
    s = w.spec
    name = outside_markup(short_worker(w.name))
    if s is None:
        return [f"[b]{name}[/] [$text-muted]no speculation (simulated)[/]"]
    if not s["drafts"]:
        modes = "/".join(m for m in w.spec_modes if m != "off")
        return [f"[b]{name}[/] [$text-muted]no drafts verified yet ({outside_markup(modes or 'off')})[/]"]
    spark = spark_bars(w.spec_history, max(4, min(24, width - 40)))
    mean = s["mean_accepted_length"]
    lines = [f"[b]{name}[/] acc [b]{pct(s['acceptance_rate'])}[/] [$accent]{spark}[/] "
             f"len [b]{mean:.2f}[/] k {s['k']}  {s['drafts']} rounds"]
    if s.get("gain"):
        lines.append(gain_line(s))
    for i, a in enumerate(s["acceptance_per_position"][:MAX_POSITIONS]):
        lines.append(f"  pos {i + 1} [$success]{bar(a)}[/] {pct(a)}")
    return lines


def gain_line(s: dict) -> str:
    gain = s["gain"]
    colour = "$success" if gain >= 1.0 else "$error"
    return (f"  gain [b][{colour}]×{gain:.2f}[/][/]  {s['spec_tok_s']:.1f} tok/s "
            f"[$text-muted]vs {s['plain_tok_s_est']:.1f} est. without[/]")


def request_line(r: RequestView) -> str:
    s = r.spec or {}
    mode = outside_markup(s.get("mode", "off"))
    return (f"{outside_markup(r.id)} {mode} k {s.get('k', 0)} acc {pct(s.get('acceptance_rate'))} "
            f"len {s['mean_accepted_length']:.2f}" if s.get("mean_accepted_length") else
            f"{outside_markup(r.id)} {mode} k {s.get('k', 0)} acc —")


def spec_markup(workers: tuple[WorkerView, ...], requests: tuple[RequestView, ...], mode: str, width: int) -> str:
    lines = [f"new requests: [b]{outside_markup(mode or 'worker default')}[/] [$text-muted](s cycles)[/]"]
    for w in workers:
        if w.state == "ready":
            lines += worker_lines(w, width)
    live = [r for r in requests if r.state in LIVE and r.spec]
    if live:
        lines.append("[$text-muted]speculating requests[/]")
        lines += [request_line(r) for r in live[-8:]]
    return "\n".join(lines)


class SpecPanel(VerticalScroll):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._body = Static("")
        self._shown = ""

    def compose(self):
        yield self._body

    def show_spec(self, workers: tuple[WorkerView, ...], requests: tuple[RequestView, ...], mode: str) -> None:
        text = spec_markup(workers, requests, mode, max(20, self.scrollable_content_region.width))
        if text != self._shown:
            self._shown = text
            body = self._body
            body.update(text, layout=False)
            # A layout pass only when the text's height (its lines wrapped at the panel's width)
            # changes: the figures change at every refresh, the height seldom.
            width = body.size.width
            if not width or body.visual.get_height(body.styles, width) != body.size.height:
                body.refresh(layout=True)


# terminal columns from which the panel is shown: below, the request table's spec column and
# the help carry it (z zooms a panel)
MIN_WIDTH = 120
PANEL = PanelSpec(SpecPanel, id="spec", box="spec", row="bottom", title="speculation", min_width=MIN_WIDTH,
                  draw=lambda panel, f: panel.show_spec(f.snap.workers, f.snap.requests, f.spec_mode))
