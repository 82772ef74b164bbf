"""Recent routing decisions, newest first: every candidate's inputs and score, the chosen one marked.

Enough to explain each decision after the fact: the policy, the load the router counted on
each worker (running, waiting, pending prefill and decode tokens, the reusable prefix it
estimated from the worker's published page keys), the rates it divided by, and the score.
"""
from __future__ import annotations

from textual.containers import VerticalScroll
from textual.markup import escape
from textual.widgets import Static

from app.widgets.fmt import fmt_rate, fmt_seconds
from engine.router import Candidate, RouteDecision

SHOWN = 12


def format_score(policy: str, score: float) -> str:
    return fmt_seconds(score) if policy in ("cost", "cache-aware") else f"{score:g}"


def format_candidate(c: Candidate, decision: RouteDecision) -> str:
    chosen = c.worker == decision.chosen
    mark = "[bold $success]✓[/]" if chosen else " "
    name = f"[bold]w{c.worker}[/]" if chosen else f"w{c.worker}"
    return (f" {mark} {name} {format_score(decision.policy, c.score):>6}  reuse {c.cached_tokens}  "
            f"run {c.running} wait {c.waiting}  pre {c.prefill_tokens} dec {c.decode_tokens}  @{fmt_rate(c.prefill_rate)}/{fmt_rate(c.decode_rate)} "
            f"[$text-muted]{escape(c.name)}[/]")


def format_decision(d: RouteDecision) -> str:
    chosen = next((c.name for c in d.candidates if c.worker == d.chosen), "")
    head = (f"[bold]{d.request_id}[/] → [bold $accent]w{d.chosen}[/] {escape(chosen)}  "
            f"[$text-muted]{d.policy}{' (' + d.reason + ')' if d.reason else ''} · prompt {d.prompt_tokens} "
            f"· reuse ~{d.chosen_reuse} · max {d.max_tokens}[/]")
    return "\n".join([head, *(format_candidate(c, d) for c in d.candidates)])


class RoutingPanel(VerticalScroll):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._shown_key: tuple | None = None
        self._lines = 1
        self.body = Static("[$text-muted]no routing decisions yet: press b for a burst[/]",
                           classes="routing-body")

    def compose(self):
        yield self.body

    def show_decisions(self, routing: tuple[RouteDecision, ...]) -> None:
        key = (len(routing), routing[-1].request_id) if routing else None
        if key == self._shown_key:
            return
        self._shown_key = key
        if routing:
            text = "\n".join(format_decision(d) for d in list(routing)[-SHOWN:][::-1])
            # A layout pass only when the number of lines changes (it stops changing once full).
            lines = text.count("\n") + 1
            self.body.update(text, layout=lines != self._lines)
            self._lines = lines
