"""The dashboard's slow commands, run on daemon threads so the UI never waits: a compare, a
trace export, a prompt whose length a remote must count. Each reports back through the app's
notice queue (read by its refresh timer) or call_from_thread, never with a traceback.
"""
from __future__ import annotations

import threading
from pathlib import Path

from app.flags import describe_error


def in_background(name: str, target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, name=f"tokentop-{name}", daemon=True)
    thread.start()
    return thread


def run_compare(app, spec, items) -> None:
    """Side A, then side B, each on a fresh engine; the result screen when both are done."""
    from app.screens.compare import CompareResult
    from engine.facade.compare import compare, format_report, write_report
    try:
        report = compare(app.config, items, spec.a, spec.b, burst=str(spec.path),
                         interval_s=spec.interval_ms / 1000,
                         progress=lambda text: app.engine.log("info", f"compare {text}"))
        path = write_report(report, None)
    except Exception as exc:  # reported in the UI, whatever it is
        app.post_notice("error", f"compare failed: {describe_error(exc)}")
        return
    app.engine.log("info", f"compare report written to {path}")
    try:
        app.call_from_thread(app.push_screen, CompareResult(format_report(report), path))
    except RuntimeError:      # the dashboard was closed meanwhile: the report file stays
        pass


def export_trace(app) -> None:
    """What the flight recorder kept, as one Perfetto trace in the trace directory."""
    try:
        path = Path(app.engine.export_trace(app.config.trace_dir)).resolve()
    except Exception as exc:  # reported in the UI, whatever it is
        app.post_notice("error", f"trace export failed: {describe_error(exc)}")
        return
    app.post_notice("information", f"trace written to {path}")
    app.engine.log("info", f"trace written to {path}")


def submit_prompt(app, text: str, params) -> None:
    """Submit off the UI's event loop: a remote's /tokenize may take up to its timeout."""
    try:
        handle = app.engine.submit(text, params=params)
        app.call_from_thread(app.notify, f"submitted {handle.id}")
    except Exception as exc:  # noqa: BLE001 - shown like any UI command's failure
        app.call_from_thread(app.notify, describe_error(exc), severity="error", timeout=8)
