"""Recent routing decisions, newest first: every candidate's inputs and score, the chosen one marked.

Enough to explain each decision after the fact: the policy, what it compared (the cost
router's estimated seconds, the least-loaded router's request count; round-robin takes
turns and compares nothing), and the load the router counted on each worker (running,
waiting, prefill and decode tokens still to do, reusable prefix) and the rates it divided
by. The compared figure comes first; on a narrow panel the other fields drop out.
"""
from __future__ import annotations

from textual.containers import VerticalScroll
from textual.widgets import Static

from app.widgets.fmt import fit_parts, fmt_rate, fmt_seconds, outside_markup, short_worker
from app.widgets.panel import PanelSpec
from engine.facade.router import Candidate, RouteDecision

SHOWN = 12
POLICY_NOTE = {"cost": "least estimated seconds of work wins",
               "cache-aware": "longest reusable prefix unless load is imbalanced",
               "least-loaded": "fewest requests wins",
               "round-robin": "takes turns, no score",
               "forced": "worker given by the caller, no score"}


# a remote serving another model counts the prompt its own way: say where its figure came from
PROMPT_SOURCE = {"remote": "prompt {n} tok (its /tokenize)",
                 "estimate": "[$warning]prompt ~{n} tok (estimate)[/]"}


def format_score(policy: str, score: float) -> str | None:
    """The figure the policy compared, in words; None when it compares nothing."""
    if policy in ("cost", "cache-aware"):
        return f"est {fmt_seconds(score)}"
    if policy == "least-loaded":
        return f"{score:g} req"
    return None


def format_candidate(c: Candidate, decision: RouteDecision, width: int) -> str:
    chosen = c.worker == decision.chosen
    mark = "[bold $success]✓[/]" if chosen else " "
    name = outside_markup(short_worker(c.name))
    head = f"{mark} [bold]{name}[/]" if chosen else f"{mark} {name}"
    score = format_score(decision.policy, c.score)
    if score and c.nominal:   # no speed profile yet: the estimate rests on placeholder rates
        score += " [$warning]nominal[/]"
    parts = [(0, f"{head} [b]{score}[/]" if score else f"{head} [$text-muted](no score)[/]"),
             *([(1, PROMPT_SOURCE[c.prompt_source].format(n=c.prompt_tokens))]
               if c.prompt_source in PROMPT_SOURCE else []),
             (1, f"reuse ~{c.cached_tokens} tok"),     # estimated reusable prefix
             (1, f"run {c.running} wait {c.waiting}"),
             (2, f"prefill {c.prefill_tokens} tok"), (2, f"decode {c.decode_tokens} tok"),
             (4, f"[$text-muted]at {fmt_rate(c.prefill_rate)}/{fmt_rate(c.decode_rate)} tok/s"
                 f"{' nominal (not calibrated yet)' if c.nominal else ''}[/]")]
    return " " + fit_parts(parts, width - 1)


def format_decision(d: RouteDecision, width: int = 10_000) -> str:
    chosen = next((c.name for c in d.candidates if c.worker == d.chosen), f"w{d.chosen}")
    reason = f" ({d.reason})" if d.reason else ""
    to = outside_markup(short_worker(chosen))
    parts = [(0, f"[bold]{outside_markup(d.request_id)}[/] → [bold $accent]{to}[/]"),
             (1, f"[$text-muted]{outside_markup(d.policy + reason)}[/]"),
             (3, f"[$text-muted]{POLICY_NOTE.get(d.policy, '')}[/]"),
             (2, f"[$text-muted]prompt {d.prompt_tokens} · max {d.max_tokens}[/]")]
    return "\n".join([fit_parts(parts, width), *(format_candidate(c, d, width) for c in d.candidates)])


class RoutingPanel(VerticalScroll):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._shown_key: tuple | None = None
        self._lines = 1
        self._routing: tuple[RouteDecision, ...] = ()
        self.body = Static("[$text-muted]no routing decisions yet: press b for a burst[/]",
                           classes="routing-body")

    def compose(self):
        yield self.body

    def on_resize(self) -> None:
        self._shown_key = None
        self.show_decisions(self._routing)

    def show_decisions(self, routing: tuple[RouteDecision, ...]) -> None:
        width = self.scrollable_content_region.width or 10_000
        key = (len(routing), routing[-1].request_id, width) if routing else None
        if key == self._shown_key:
            return
        self._shown_key = key
        self._routing = routing
        if routing:
            text = "\n".join(format_decision(d, width) for d in list(routing)[-SHOWN:][::-1])
            # A layout pass only when the number of lines changes (it stops changing once full).
            lines = text.count("\n") + 1
            self.body.update(text, layout=lines != self._lines)
            self._lines = lines


# terminal columns from which the routing panel is shown (below, the latency panel has its place)
MIN_WIDTH = 120
PANEL = PanelSpec(RoutingPanel, id="routing", box="routing", row="middle", title="routing",
                  min_width=MIN_WIDTH, draw=lambda panel, f: panel.show_decisions(f.snap.routing))
