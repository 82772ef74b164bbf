"""Alerts: rules over the stream of engine snapshots, each raised once per episode.

Rules (every threshold is in THRESHOLDS, below):

  stall         a worker's decode rate fell under 25% of its median over the last 60 s
                (samples taken while it was running something) while requests wait on it
  kv-pressure   a worker preempted a request in the last 10 s, or holds >= 95% of its KV pages
                (a remote: its scraped KV usage)
  imbalance     one worker has at least twice the waiting requests of every other ready
                worker (and at least 2) while another ready worker sits idle
  worker-dead   a worker's process died
  remote-down   a remote worker's server stopped answering

A condition must hold for its `hold` seconds to raise an alert (a burst being routed is not an
imbalance) and be gone for its `clear` seconds to end it (a flapping rate is one episode, not
ten). The monitor sees only snapshots, so a test can feed it a made-up stream; AlertWatcher
runs it on the engine's own snapshots, logs each episode's start and end once, marks both as
instants in the flight recorder's ring (an "alerts" track in the trace `t` writes), and keeps
the count of episodes per (kind, worker) that /metrics exports as tokentop:alerts_total.
"""
from __future__ import annotations

import statistics
import threading
from collections import deque
from dataclasses import dataclass

from engine.errors import describe_error

KINDS = ("stall", "kv-pressure", "imbalance", "worker-dead", "remote-down")
PERIOD_S = 0.5      # how often the engine's watcher looks


@dataclass(frozen=True)
class Thresholds:
    stall_fraction: float = 0.25      # decode rate under this share of its median ...
    stall_window_s: float = 60.0      # ... over this many seconds of busy samples
    stall_min_history_s: float = 10.0  # ... once that history spans this long
    kv_usage: float = 0.95            # share of KV pages in use
    kv_preempt_window_s: float = 10.0  # a preemption this recent counts
    imbalance_ratio: float = 2.0      # one queue this many times every other one
    imbalance_min_waiting: int = 2    # ... and at least this long
    # seconds a condition must hold before it is an alert, and be gone before the alert ends
    hold_s: tuple[tuple[str, float], ...] = (("stall", 2.0), ("imbalance", 2.0))
    clear_s: tuple[tuple[str, float], ...] = (("stall", 5.0), ("kv-pressure", 5.0), ("imbalance", 5.0))

    def hold(self, kind: str) -> float:
        return dict(self.hold_s).get(kind, 0.0)

    def clear(self, kind: str) -> float:
        return dict(self.clear_s).get(kind, 0.0)


THRESHOLDS = Thresholds()


@dataclass(frozen=True)
class Alert:
    kind: str           # one of KINDS
    worker: int
    worker_name: str
    since: float        # snapshot time (time.time()) the episode started
    message: str        # what was seen when it started

    def to_json(self) -> dict:
        return {"kind": self.kind, "worker": self.worker, "worker_name": self.worker_name,
                "since": self.since, "message": self.message}


@dataclass
class _Episode:
    first_seen: float            # the condition has held since
    message: str
    alert: Alert | None = None   # raised (after its hold time)
    gone_since: float | None = None


class AlertMonitor:
    """Feed it snapshots in time order (`observe`); it says which alerts started and ended."""

    def __init__(self, thresholds: Thresholds = THRESHOLDS) -> None:
        self.t = thresholds
        self._episodes: dict[tuple[str, int], _Episode] = {}
        self._busy: dict[int, deque[tuple[float, float]]] = {}   # worker -> (time, decode tok/s)
        self._preempt: dict[int, tuple[int, float | None]] = {}  # worker -> (count seen, last increase)
        self.totals: dict[tuple[str, str], int] = {}             # (kind, worker name) -> episodes

    def active(self) -> tuple[Alert, ...]:
        return tuple(sorted((e.alert for e in self._episodes.values() if e.alert is not None),
                            key=lambda a: (a.since, a.worker, a.kind)))

    def observe(self, snap) -> tuple[list[Alert], list[Alert]]:
        """(alerts that started, alerts that ended) at this snapshot."""
        now = snap.time
        seen = self._conditions(snap)
        started, ended = [], []
        for key, message in seen.items():
            ep = self._episodes.get(key)
            if ep is None:
                ep = self._episodes[key] = _Episode(now, message)
            ep.gone_since = None
            if ep.alert is None:
                ep.message = message
                if now - ep.first_seen >= self.t.hold(key[0]):
                    name = next((w.name for w in snap.workers if w.index == key[1]), f"w{key[1]}")
                    ep.alert = Alert(key[0], key[1], name, now, message)
                    self.totals[key[0], name] = self.totals.get((key[0], name), 0) + 1
                    started.append(ep.alert)
        for key in [k for k in self._episodes if k not in seen]:
            ep = self._episodes[key]
            if ep.alert is None:          # never raised: forget it at once
                del self._episodes[key]
                continue
            if ep.gone_since is None:
                ep.gone_since = now
            if now - ep.gone_since >= self.t.clear(key[0]):
                del self._episodes[key]
                ended.append(ep.alert)
        return started, ended

    # --- the rules --------------------------------------------------------------------------
    def _conditions(self, snap) -> dict[tuple[str, int], str]:
        """(kind, worker) -> what is wrong, for every condition that holds in this snapshot."""
        out: dict[tuple[str, int], str] = {}
        now = snap.time
        for w in snap.workers:
            if w.state == "dead":
                out["worker-dead", w.index] = f"worker {w.index} ({w.name}) died: {w.message or 'no reason given'}"
            elif w.state == "down":
                out["remote-down", w.index] = f"remote worker {w.index} ({w.name}) is down: {w.message or 'no answer'}"
            if w.state != "ready":
                continue
            stall = self._stall(w, now)
            if stall:
                out["stall", w.index] = stall
            kv = self._kv_pressure(w, now)
            if kv:
                out["kv-pressure", w.index] = kv
        out.update(self._imbalance(snap))
        return out

    def _stall(self, w, now: float) -> str | None:
        history = self._busy.setdefault(w.index, deque())
        stalled = ("stall", w.index) in self._episodes
        baseline = None
        if history and history[-1][0] - history[0][0] >= self.t.stall_min_history_s:
            baseline = statistics.median(rate for _, rate in history)
        low = baseline is not None and baseline > 0 and w.decode_tps < self.t.stall_fraction * baseline
        if w.waiting > 0 and low:
            # the median stays what it was before the stall: the stall's own samples would pull
            # it down until the stall no longer looked like one
            return (f"worker {w.index} ({w.name}) stalled: decode {w.decode_tps:.0f} tok/s, under "
                    f"{100 * self.t.stall_fraction:.0f}% of its {self.t.stall_window_s:.0f} s median "
                    f"{baseline:.0f} tok/s, with {w.waiting} waiting")
        if not stalled and w.running > 0:
            history.append((now, w.decode_tps))
            while history and history[0][0] < now - self.t.stall_window_s:
                history.popleft()
        return None

    def _kv_pressure(self, w, now: float) -> str | None:
        count, last = self._preempt.get(w.index, (w.preemptions, None))
        if w.preemptions > count:
            last = now
        self._preempt[w.index] = (w.preemptions, last)
        usage = w.pages_used / w.pages_total if w.pages_total else w.kv_usage
        recent = last is not None and now - last <= self.t.kv_preempt_window_s
        full = usage is not None and usage >= self.t.kv_usage
        if not (recent or full):
            return None
        why = [f"{100 * usage:.0f}% of KV in use"] if usage is not None else []
        if recent:
            why.append(f"preempting (last {now - last:.0f} s ago, {w.preemptions} in all)")
        return f"worker {w.index} ({w.name}) KV pressure: " + ", ".join(why)

    def _imbalance(self, snap) -> dict[tuple[str, int], str]:
        ready = [w for w in snap.workers if w.state == "ready"]
        idle = [w for w in ready if w.running == 0 and w.waiting == 0]
        out = {}
        for w in ready:
            others = [o.waiting for o in ready if o is not w]
            spare = [o for o in idle if o is not w]
            if not others or not spare or w.waiting < self.t.imbalance_min_waiting:
                continue
            if w.waiting >= self.t.imbalance_ratio * max(others):
                out["imbalance", w.index] = (f"worker {w.index} ({w.name}) has {w.waiting} waiting while "
                                             f"worker {spare[0].index} ({spare[0].name}) sits idle")
        return out


class AlertWatcher:
    """The monitor on the engine's own snapshots, PERIOD_S apart, on a thread of its own; each
    episode is one log line when it starts and one when it ends."""

    def __init__(self, engine, thresholds: Thresholds = THRESHOLDS, period: float = PERIOD_S) -> None:
        self.engine = engine
        self.monitor = AlertMonitor(thresholds)
        self.period = period
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokentop-alerts", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)

    def active(self) -> tuple[Alert, ...]:
        with self._lock:
            return self.monitor.active()

    def totals(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self.monitor.totals)

    def check(self) -> None:
        """One look: the rules on a snapshot taken now."""
        snap = self.engine.snapshot()
        with self._lock:
            started, ended = self.monitor.observe(snap)
        tracer = self.engine.recorder.tracer
        for a in started:
            self.engine.log("error" if a.kind == "worker-dead" else "warning", f"alert {a.kind}: {a.message}")
            tracer.instant(f"alert: {a.kind}", worker=a.worker, worker_name=a.worker_name, message=a.message)
        for a in ended:
            self.engine.log("info", f"alert {a.kind} over on worker {a.worker} ({a.worker_name}), "
                                    f"after {snap.time - a.since:.0f} s")
            tracer.instant(f"alert over: {a.kind}", worker=a.worker, worker_name=a.worker_name,
                           lasted_s=round(snap.time - a.since, 1))

    def _run(self) -> None:
        self.engine.recorder.tracer.set_thread_name("alerts")   # the track its markers go on
        failed = None
        while not self._stop.wait(self.period):
            try:
                self.check()
                failed = None
            except Exception as exc:  # noqa: BLE001 - a rule's bug must not stop the engine
                if describe_error(exc) != failed:     # said once, not twice a second
                    failed = describe_error(exc)
                    self.engine.log("error", f"alert rules failed: {failed}")
