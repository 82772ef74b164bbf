"""The dashboard's header line: what runs, how fast, under which policies.

On a narrow terminal the fields drop out by priority (the higher the number, the sooner); the
name and burst progress always stay.
"""
from __future__ import annotations

from app.widgets.fmt import fmt_rate, fmt_seconds, fmt_uptime, outside_markup, short_worker
from engine.facade.snapshot import EngineSnapshot


def header_parts(app) -> list[tuple[int, str]]:
    """(priority, markup) of each field, from a TokentopApp's last snapshot and its state."""
    snap: EngineSnapshot | None = app.last_snapshot
    workers = snap.workers if snap else ()
    ready = sum(w.state == "ready" for w in workers)
    active = sum(r.state.live for r in snap.requests) if snap else 0
    # live: the engine's own (a key changes it before the next snapshot); else the picture's
    detail = app.engine.recorder.detail if app.live or snap is None else snap.trace_detail
    tracing = "[b $success]full[/]" if detail == "full" else outside_markup(detail)
    parts = [(0, "[b $accent]tokentop[/]")]
    if snap is not None and snap.alerts:
        parts.append((0, alert_badge(snap.alerts)))
    for run in app.bursts:
        parts.append((0, f"burst {outside_markup(run.name)} {run.submitted}/{run.spec.count}"))
    parts += [(1, f"{ready}/{len(app.config.workers)} ready"), (1, f"{active} active")]
    if snap is not None:
        live = [w for w in workers if w.state == "ready"]
        parts.append((2, f"decode {fmt_rate(sum(w.decode_tps for w in live))} tok/s"))
        parts.append((5, f"prefill {fmt_rate(sum(w.prefill_tps for w in live))} tok/s"))
        parts += latency_parts(snap, app.latency_window)
    # a replay's policies are the recording's words
    parts += [(3, f"router [b]{outside_markup(app.router_policy)}[/]"),
              (3, f"sched [b]{outside_markup(app.scheduler_policy)}[/]"), (3, f"trace {tracing}")]
    if app.serve_url:
        parts.append((1, f"api {app.serve_url}"))
    if snap is not None and snap.uptime:
        parts.append((4, f"up {fmt_uptime(snap.uptime)}"))
    return parts


def latency_parts(snap: EngineSnapshot, window: str) -> list[tuple[int, str]]:
    """The latency panel's headline figures: p50 and p99 of TTFT and ITL, then e2e, over its window."""
    view = snap.latency.get(window)
    if view is None:
        return []
    parts = []
    for priority, metric, label in ((2, "ttft", "TTFT"), (3, "itl", "ITL"), (6, "e2e", "e2e")):
        s = view.summary(metric)
        if s.count:
            parts.append((priority, f"{label} p50 {fmt_seconds(s.p50)} p99 {fmt_seconds(s.p99)}"))
    return parts


def alert_badge(alerts) -> str:
    """The header's badge: the one alert active, or how many (the log says what each is)."""
    if len(alerts) == 1:
        a = alerts[0]
        return f"[b reverse $error] ⚠ {outside_markup(a.kind)} {outside_markup(short_worker(a.worker_name))} [/]"
    return f"[b reverse $error] ⚠ {len(alerts)} alerts [/]"
