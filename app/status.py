"""`tokentop status [URL] [--json]`: a running server's snapshot (GET /snapshot), printed once.

A short table: the workers, the latency percentiles over a window, the alerts active now.
--json prints the snapshot as the server sent it (docs/snapshot.md). A server that cannot be
reached, refuses the key or speaks another snapshot version is a one-line error.
"""
from __future__ import annotations

import json

from app.printing import out
from app.widgets.fmt import fmt_mib, fmt_rate, fmt_seconds, fmt_uptime, short_worker
from engine.errors import TokentopError
from engine.outside import visible

SNAPSHOT_VERSION = 1     # the version of engine/serve/snapshot_json.py this reads
METRICS = (("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "e2e"), ("queue", "queue"))


def fetch_snapshot(url: str, api_key: str | None, timeout: float) -> dict:
    """The server's /snapshot, all of it within `timeout` seconds and the body under its cap
    (engine/watch/fetch.py); any failure is a one-line TokentopError."""
    import httpx

    from engine.outside import OutsideDataError
    from engine.watch.fetch import MAX_SNAPSHOT_BODY, Deadline, FetchError, get

    base = url.rstrip("/")
    if "://" not in base:
        base = "http://" + base
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client() as client:
            r = get(client, base + "/snapshot", Deadline(timeout), headers=headers, max_bytes=MAX_SNAPSHOT_BODY)
    except FetchError as exc:
        raise TokentopError(_fetch_failed(base, exc, timeout)) from None
    if r.status == 401:
        raise TokentopError(f"{visible(base)} wants an API key: pass the server's --api-key with --api-key KEY")
    if r.status != 200:
        raise TokentopError(f"{visible(base)}/snapshot answered {r.status}: {r.excerpt()}")
    try:
        snap = r.json()
    except OutsideDataError as exc:
        raise TokentopError(f"{exc}: is it a tokentop server?") from None
    if not isinstance(snap, dict) or snap.get("version") != SNAPSHOT_VERSION:
        version = snap.get("version") if isinstance(snap, dict) else None
        raise TokentopError(f"{visible(base)}/snapshot is version {visible(repr(version))[:40]}; this tokentop "
                            f"reads version {SNAPSHOT_VERSION}: use the same tokentop release on both ends")
    return snap


def _fetch_failed(base: str, exc, timeout: float) -> str:
    if exc.kind == "unreachable":
        return (f"cannot reach {visible(base)}: {exc.reason}; is `tokentop serve` (or `tokentop --serve PORT`) "
                "running there?")
    if exc.kind == "late":
        return f"{visible(base)}/snapshot: {exc.reason}; a slow server may need more --timeout (now {timeout:g})"
    return f"{visible(base)}/snapshot: {exc.reason}; is it a tokentop server?"


def status_text(snap: dict, url: str, window: str) -> str:
    workers = snap["workers"]
    ready = sum(w["state"] == "ready" for w in workers)
    live = sum(r["state"] in ("queued", "prefill", "decode") for r in snap["requests"])
    lines = [f"tokentop at {url} · up {fmt_uptime(snap['uptime'])} · {ready}/{len(workers)} workers ready · "
             f"{live} requests live · router {snap['router_policy']}", ""]
    rows = [("worker", "state", "run", "wait", "prefill", "decode", "KV", "CPU", "RSS")]
    for w in workers:
        usage = w["kv"]["usage"]
        rows.append((f"w{w['index']} {short_worker(w['name'])}", w["state"], f"{w['running']}/{w['max_active']}",
                     str(w["waiting"]), fmt_rate(w["prefill_tps"]), fmt_rate(w["decode_tps"]),
                     "-" if usage is None else f"{100 * usage:.0f}%",
                     "-" if w["cpu_percent"] is None else f"{w['cpu_percent']:.0f}%",
                     "-" if w["rss_bytes"] is None else fmt_mib(w["rss_bytes"])))
    lines += table(rows, left=2) + [""]
    view = snap["latency"].get(window)
    if view is None:
        raise TokentopError(f"the server has no latency window {window!r} (it has {', '.join(snap['latency'])})")
    title = "the whole session" if view["seconds"] is None else f"the last {view['seconds']:g} s"
    rows = [(f"latency, {title}", "p50", "p95", "p99", "n")]
    for key, label in METRICS:
        s = view["overall"].get(key, {"count": 0, "p50": None, "p95": None, "p99": None})
        rows.append((label, fmt_seconds(s["p50"]), fmt_seconds(s["p95"]), fmt_seconds(s["p99"]), str(s["count"])))
    lines += table(rows) + [""]
    if snap["alerts"]:
        lines += [f"alert {a['kind']}: {a['message']}" for a in snap["alerts"]]
    else:
        lines.append("no alerts")
    return "\n".join(lines)


def table(rows: list[tuple[str, ...]], left: int = 1) -> list[str]:
    """Columns padded to their widest cell: the first `left` columns (names) to the left, the
    figures to the right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(text.ljust(widths[i]) if i < left else text.rjust(widths[i])
                      for i, text in enumerate(row)).rstrip() for row in rows]


def cmd_status(args) -> int:
    snap = fetch_snapshot(args.url, args.api_key, args.timeout)
    if args.json:
        print(json.dumps(snap, indent=2))
        return 0
    try:
        text = status_text(snap, args.url, args.window)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:   # a field missing or mistyped
        from engine.watch.fetch import one_line
        raise TokentopError(f"{visible(args.url)}/snapshot does not have version {SNAPSHOT_VERSION}'s shape "
                            f"({type(exc).__name__}: {one_line(str(exc), 80)}): use the same tokentop release "
                            "on both ends") from None
    out(text)    # every name in it is the server's
    return 0
