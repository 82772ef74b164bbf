"""Trace export: every worker's trace events, the facade's, and each request's lifecycle
built from the request table, written as one Chrome JSON file (Perfetto)."""
from __future__ import annotations

import threading
import time
from pathlib import Path

from engine import messages as msg
from engine.errors import TokentopError
from engine.facade.requests import RequestTable, seen_timings
from engine.facade.snapshot import RequestState
from engine.trace import Tracer, request_track_events, write_chrome_trace

UNWRITTEN_TRACE_EVENTS = 2_000_000   # most trace events kept after a failed export


class TraceExport:
    def __init__(self, lock: threading.RLock, tracing: bool):
        self._cv = threading.Condition(lock)
        self._received: dict[int, list] = {}
        self._unwritten: list = []   # events of an export that failed, kept for the next one
        self.since = time.monotonic() if tracing else None   # start of the trace window

    def received(self, event: msg.TraceEvents) -> None:
        """A worker's answer to DrainTrace (dispatcher thread)."""
        with self._cv:
            self._received[event.worker] = event.events
            self._cv.notify_all()

    def tracing_turned_on(self) -> None:
        self.since = time.monotonic()

    def export(self, target: str | Path, workers: list, requests: RequestTable, tracer: Tracer | None,
               timeout: float = 5.0) -> str:
        """Ask each ready worker (slots, engine/facade/workers.py) for its events, add the
        facade's and the request lifecycles, and write them; return the file's absolute path.
        A write error is a one-line TokentopError; nothing else is lost."""
        with self._cv:
            self._received.clear()
            ready = [w for w in workers if w.ready]
        for w in ready:
            w.send(msg.DrainTrace())
        deadline = time.monotonic() + timeout
        with self._cv:
            while len(self._received) < len(ready) and time.monotonic() < deadline:
                self._cv.wait(0.1)
            events = [e for evs in self._received.values() for e in evs]
        now = time.monotonic()
        if tracer is not None:
            events += tracer.drain()
        # Request lifecycles are built from the engine's records, so a request that was
        # already running when tracing started, or is still running now, is in the trace too.
        pid = tracer.pid if tracer is not None else 0
        with self._cv:
            events += lifecycle_events(requests, pid, self.since if self.since is not None else now, now)
        self.since = now        # the next export covers what happens from here on
        events = self._unwritten + events
        try:
            written = write_chrome_trace(target, events)
        except OSError as exc:
            self._unwritten = events[-UNWRITTEN_TRACE_EVENTS:]
            raise TokentopError(f"cannot write the trace to {Path(target).absolute()}: "
                                f"{exc.strerror or exc}; its events are kept for the next export") from None
        self._unwritten = []
        return written


def lifecycle_events(requests: RequestTable, pid: int, since: float, until: float) -> list[dict]:
    """Every request alive during [since, until] as phase spans on its own track, clipped
    to the window: queued -> prefill -> decode, then finished / aborted / failed, or the
    phase it is still in at `until` (marked running). The engine's lock is held."""
    records = [r for r in requests.records.values()
               if r.arrival <= until and (r.finished_at is None or r.finished_at >= since)]
    lifecycles = []
    for rec in records:
        m = rec.metrics
        queue_time, ttft = (m.queue_time, m.ttft) if m else seen_timings(rec)[:2]
        if ttft is None and rec.first_token_at is not None:
            ttft = rec.first_token_at - rec.arrival
        if queue_time is not None and ttft is not None:
            queue_time = min(queue_time, ttft)   # a preempted request is queued again later
        marks = [("queued", rec.arrival)]
        follow = m.follow_start if m else (rec.follow_at - rec.arrival if rec.follow_at else None)
        if follow is not None and (queue_time is None or follow < queue_time):
            marks.append(("waiting-on-leader", rec.arrival + follow))   # single flight
        if queue_time is not None:
            marks.append(("prefill", rec.arrival + queue_time))
        if ttft is not None:
            marks.append(("decode", rec.arrival + ttft))
        end = None
        if rec.finish_reason is not None:
            end = (RequestState.of_finish(rec.finish_reason).value,
                   rec.arrival + m.e2e if m else rec.finished_at or until)
        lifecycles.append((rec.id, rec.worker, marks, end))
    return request_track_events(pid, lifecycles, since, until)
