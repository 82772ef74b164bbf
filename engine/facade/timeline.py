"""Each request's timeline, as the facade sees it happen: for the dashboard's Gantt panel.

Phases carry the names of the request lifecycles in traces (engine/trace.py) and of
RequestState: queued, waiting-on-leader, prefill, decode, then finished / aborted / error; a
preempted request is `preempted` (queued again, to recompute) until its prefill restarts, as
the trace's `preempted` instant names it. Ticks mark what happens inside a phase: the end of
each prefill chunk (`prefill`, from the worker's StepEvents.prefilled) and each verify round
of a speculating request (`spec`: a step that delivered it tokens).

Times are time.monotonic() seconds, absolute; EngineSnapshot.clock says what "now" was. A
phase change is timed when the facade learns of it (the end of the step that made it), except
where the worker measured better: a finished request's first scheduling (its queue time).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from engine.facade.snapshot import RequestState

PHASES = ("queued", "waiting-on-leader", "prefill", "decode", "preempted")
ENDS = ("finished", "aborted", "error")
MAX_TICKS = 512      # per request, the latest; older ones scroll out of any sensible span


@dataclass(frozen=True)
class Timeline:
    """One request's phases [(name, start)], its end (name, time) once it has one, its ticks."""
    phases: tuple[tuple[str, float], ...]
    end: tuple[str, float] | None = None
    ticks: tuple[tuple[str, float], ...] = ()

    def phase_at(self, t: float) -> str | None:
        """The phase the request was in at time t (None before it arrived or after it ended)."""
        if not self.phases or t < self.phases[0][1] or (self.end is not None and t > self.end[1]):
            return None
        current = self.phases[0][0]
        for name, start in self.phases:
            if start > t:
                break
            current = name
        return current


class _Events:
    """What the dispatcher saw of one request: phase changes and ticks, in order."""
    __slots__ = ("changes", "ticks", "frozen")

    def __init__(self) -> None:
        self.changes: list[tuple[str, float]] = []
        self.ticks: list[tuple[str, float]] = []
        self.frozen: tuple | None = None      # (changes, ticks) as tuples, until the next event

    def change(self, phase: str, t: float) -> None:
        if not self.changes or self.changes[-1][0] != phase:
            self.changes.append((phase, t))
            self.frozen = None

    def tick(self, kind: str, t: float) -> None:
        self.ticks.append((kind, t))
        if len(self.ticks) > MAX_TICKS:
            del self.ticks[: len(self.ticks) - MAX_TICKS]
        self.frozen = None

    def as_tuples(self) -> tuple:
        if self.frozen is None:
            self.frozen = (tuple(self.changes), tuple(self.ticks))
        return self.frozen


class TimelineStore:
    """Fed by the dispatcher (on_step, under the facade's lock); read by snapshot()."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[str, _Events] = {}
        self._final: dict[str, Timeline] = {}    # ended requests' timelines: they change no more
        # a live request's timeline and what it was built from: most snapshots find it unchanged
        # (a decoding request's phases stay as they are until it ends)
        self._built: dict[str, tuple[tuple, Timeline]] = {}

    def on_step(self, event, now: float, records) -> None:
        """One StepEvents: prefill chunks, token deliveries (spec rounds), preemptions. What
        comes for a request that has ended (a dying worker's last words) is left out."""
        def live(rid: str):
            rec = records.get(rid)
            return rec if rec is not None and rec.finish_reason is None else None

        with self._lock:
            for rid, _tokens in event.prefilled:
                if live(rid) is not None:
                    ev = self._get(rid)
                    ev.change("prefill", now)
                    ev.tick("prefill", now)
            for rid in {d.request_id for d in event.tokens if d.token_id >= 0}:
                rec = live(rid)
                if rec is not None:
                    ev = self._get(rid)
                    ev.change("decode", now)
                    if rec.spec is not None:
                        ev.tick("spec", now)
            for rid in event.preempted:
                if live(rid) is not None:
                    self._get(rid).change("preempted", now)

    def _get(self, rid: str) -> _Events:
        ev = self._events.get(rid)
        if ev is None:
            ev = self._events[rid] = _Events()
        return ev

    def timelines(self, records) -> dict[str, Timeline]:
        """request id -> Timeline for every record given; what is kept of requests the table
        has forgotten goes."""
        out = {}
        with self._lock:
            for rid in [rid for rid in self._events if rid not in records]:
                del self._events[rid]
            for rid in [rid for rid in self._final if rid not in records]:
                del self._final[rid]
            for rid in [rid for rid in self._built if rid not in records]:
                del self._built[rid]
            for rec in records.values():
                done = self._final.get(rec.id)
                if done is None:
                    ev = self._events.get(rec.id)
                    changes, ticks = ev.as_tuples() if ev is not None else ((), ())
                    inputs = (changes, ticks, rec.follow_at, rec.prefill_at, rec.metrics, rec.finish_reason,
                              rec.finished_at)
                    built = self._built.get(rec.id)
                    if built is not None and built[0] == inputs:
                        done = built[1]
                    else:
                        done = build(rec, changes, ticks)
                        self._built[rec.id] = (inputs, done)
                    if rec.finish_reason is not None and rec.metrics is not None:
                        self._final[rec.id] = done
                        del self._built[rec.id]
                out[rec.id] = done
        return out


def build(rec, changes: tuple, ticks: tuple) -> Timeline:
    """A record's Timeline: queued at arrival, waiting-on-leader when the facade saw it follow,
    then the phase changes the dispatcher saw; the first prefill moved to the worker's own
    scheduling time (a finished request's queue time) or the stats' first sight of it, when
    earlier than the end of its first chunk."""
    phases = [("queued", rec.arrival)]
    if rec.follow_at is not None:
        phases.append(("waiting-on-leader", rec.follow_at))
    m = rec.metrics
    started = [t for t in (rec.arrival + m.queue_time if m is not None and m.queue_time is not None else None,
                           rec.prefill_at) if t is not None]
    first_prefill = True
    for name, t in changes:
        if name == "prefill" and first_prefill:
            first_prefill = False
            t = min([t, *started])
        elif name == "decode" and first_prefill and started:
            # tokens before any chunk was seen (a remote worker reports none): prefill ran before
            phases.append(("prefill", min(started)))
            first_prefill = False
        phases.append((name, t))
    if first_prefill and started and rec.finish_reason is None:
        phases.append(("prefill", min(started)))       # scheduled, no chunk seen yet
    phases.sort(key=lambda p: p[1])
    end = None
    if rec.finish_reason is not None:
        end = (RequestState.of_finish(rec.finish_reason).value,
               rec.finished_at if rec.finished_at is not None else phases[-1][1])
    return Timeline(tuple(phases), end, ticks)
