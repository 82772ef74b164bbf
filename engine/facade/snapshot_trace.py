"""A recording (engine/facade/snapshot_file.py) as a Perfetto trace: `tokentop replay FILE --trace OUT`.

What five snapshots a second can show, on the tracks a live trace uses: per worker, counters
of KV pages, running / waiting requests and prefill / decode tok/s; per request, its
lifecycle (queued -> prefill -> decode -> its end, from its timings and age); on the facade,
each routing decision (with every candidate's score) and each log line as an instant.
Timestamps are seconds since the recording started (the trace's zero).
"""
from __future__ import annotations

import os

from engine.facade.snapshot import RequestView
from engine.facade.recording_read import Recording
from engine.trace import request_track_events, synthetic_pid, write_chrome_trace


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 1)


def recording_events(rec: Recording) -> list[dict]:
    engine_pid = synthetic_pid("engine")
    events: list[dict] = [{"ph": "M", "name": "process_name", "pid": engine_pid, "tid": 0,
                           "args": {"name": "engine"}},
                          {"ph": "M", "name": "thread_name", "pid": engine_pid, "tid": 1,
                           "args": {"name": "routing and log"}}]
    named: set[int] = set()
    seen_routes: set[tuple[str, float]] = set()
    seen_log: set[tuple[float, str]] = set()
    last: dict[str, tuple[float, RequestView]] = {}     # request id -> (frame time, latest view)
    end = 0.0
    for i in range(len(rec)):
        snap, _ = rec.frame(i)
        t = snap.time - rec.started
        end = t
        for w in snap.workers:
            pid = synthetic_pid(f"worker {w.index} ({w.device})")
            if pid not in named:
                named.add(pid)
                events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                               "args": {"name": f"worker {w.index} ({w.device})"}})
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 0,
                               "args": {"name": "counters"}})
            ts = _us(t)
            events.append({"ph": "C", "name": "kv pages", "pid": pid, "tid": 0, "ts": ts,
                           "args": {"used": w.pages_used, "free": w.pages_total - w.pages_used}})
            events.append({"ph": "C", "name": "requests", "pid": pid, "tid": 0, "ts": ts,
                           "args": {"running": w.running, "waiting": w.waiting}})
            events.append({"ph": "C", "name": "tok/s", "pid": pid, "tid": 0, "ts": ts,
                           "args": {"prefill": w.prefill_tps, "decode": w.decode_tps}})
        for d in snap.routing:
            if (d.request_id, d.time) in seen_routes:
                continue
            seen_routes.add((d.request_id, d.time))
            events.append({"ph": "i", "s": "t", "name": "route", "pid": engine_pid, "tid": 1,
                           "ts": _us(d.time - rec.started),
                           "args": {"request": d.request_id, "chosen": d.chosen, "policy": d.policy,
                                    "reason": d.reason, "scores": {c.worker: c.score for c in d.candidates},
                                    "reuse": {c.worker: c.cached_tokens for c in d.candidates}}})
        for line in snap.log:
            if (line.time, line.text) in seen_log:
                continue
            seen_log.add((line.time, line.text))
            events.append({"ph": "i", "s": "t", "name": f"log {line.level}", "pid": engine_pid, "tid": 1,
                           "ts": _us(line.time - rec.started), "args": {"text": line.text}})
        for r in snap.requests:
            last[r.id] = (t, r)
    lifecycles = []
    for rid, (t, r) in last.items():
        arrival = t - r.age
        marks = [("queued", arrival)]
        if r.queue_time is not None:
            marks.append(("prefill", arrival + min(r.queue_time, r.ttft if r.ttft is not None else r.queue_time)))
        if r.ttft is not None:
            marks.append(("decode", arrival + r.ttft))
        finished = None if r.state.live else (r.state.value, arrival + (r.e2e or 0.0))
        lifecycles.append((rid, r.worker, marks, finished))
    events += request_track_events(engine_pid, lifecycles, 0.0, end)
    return events


def write_recording_trace(rec: Recording, path: str | os.PathLike) -> str:
    return write_chrome_trace(path, recording_events(rec), metadata={
        "source": os.path.abspath(rec.path), "recording_started_unix": rec.started,
        "clock": "seconds since the recording started (µs)"})
