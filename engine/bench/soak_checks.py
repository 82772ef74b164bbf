"""`bench soak`'s accounting and verdicts (engine/bench/soak.py runs the soak).

Two ledgers count every request of the run:
* Ledger: the clients' side. Each request the soak sends is opened once and closed with one
  terminal outcome: finished, aborted, failed (with its reason) or disconnected (the client
  went away on purpose). Still open at the end = lost; closed twice = doubled; a token after
  its finish, or a finished request with other than the tokens it asked for, is counted too.
* EngineLedger: the engine's side, through its observer hook: every request it routed must
  finish exactly once.
Both keep one byte per request, so a long soak's own bookkeeping does not read as a leak.

The verdicts are plain functions of the samples, so they can be checked on synthetic ones.
"""
from __future__ import annotations

import re
import threading
from collections import Counter

from engine.kv.states import CACHED, SHARED, USED
from engine.stats import median

FINISHED, ABORTED, FAILED, DISCONNECTED = "finished", "aborted", "failed", "disconnected"
OUTCOMES = (FINISHED, ABORTED, FAILED, DISCONNECTED)
_CODE = {name: i + 1 for i, name in enumerate(OUTCOMES)}   # 0: still open

# what the soak's own disruptions fail, by the engine's words: the killed worker's requests
# ("worker 1 (sim:soak1) died: ...") and the remote's streams its restart cut
DISRUPTION_MARKS = ("died", "failed mid-stream", "no other worker is ready")
EXAMPLES_KEPT = 20     # anomalies and failure reasons quoted in the report

WARMUP_FRACTION = 0.2  # the first part of each process's samples, not judged
RSS_GROWTH_LIMIT_PCT = 5.0
MIN_JUDGED_SAMPLES = 4
FD_SLACK = 16          # descriptors a pool may hold beyond its warmed-up count


def is_disruption(reason: str) -> bool:
    return any(mark in reason for mark in DISRUPTION_MARKS)


def _shape(reason: str) -> str:
    """A failure reason with its numbers blanked, so failures of one cause count together."""
    return re.sub(r"\d+", "N", reason.splitlines()[0] if reason else "no reason given")[:200]


class Ledger:
    """The clients' account: one byte per request (0 open, else its outcome's code)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._state = bytearray()
        self.doubled = 0
        self.after_finish = 0
        self.incomplete = 0
        self.failed_by_disruption = 0
        self.failed_unexpected = 0
        self._reasons: Counter = Counter()
        self._anomalies: list[str] = []
        self._open: dict[int, str] = {}      # what each open request is: a lost one is named

    def open(self, what: str = "") -> int:
        """A new request (`what`: how it was sent); its number."""
        with self._lock:
            self._state.append(0)
            self._open[len(self._state) - 1] = what
            return len(self._state) - 1

    def describe(self, number: int, what: str) -> None:
        with self._lock:
            if number in self._open:
                self._open[number] = what

    def close(self, number: int, outcome: str, reason: str = "") -> None:
        code = _CODE[outcome]
        with self._lock:
            before = self._state[number]
            if before:
                self.doubled += 1
                self._note(f"request {number} ended twice: {OUTCOMES[before - 1]}, then {outcome}")
                return
            self._state[number] = code
            self._open.pop(number, None)
            if outcome == FAILED:
                if is_disruption(reason):
                    self.failed_by_disruption += 1
                else:
                    self.failed_unexpected += 1
                self._reasons[_shape(reason)] += 1

    def streamed_after_finish(self, number: int, what: str) -> None:
        with self._lock:
            self.after_finish += 1
            self._note(f"request {number}: {what} after its finish")

    def wrong_length(self, number: int, what: str) -> None:
        """A request that finished with other than the tokens it asked for."""
        with self._lock:
            self.incomplete += 1
            self._note(f"request {number}: {what}")

    def _note(self, text: str) -> None:
        if len(self._anomalies) < EXAMPLES_KEPT:
            self._anomalies.append(text)

    def totals(self) -> dict:
        """Requests sent and how many reached each outcome (cheap: for every sample)."""
        with self._lock:
            counts = {name: self._state.count(code) for name, code in _CODE.items()}
            return {"submitted": len(self._state), "open": self._state.count(0), **counts}

    def summary(self) -> dict:
        totals = self.totals()
        with self._lock:
            return {**totals, "lost": totals["open"], "doubled": self.doubled,
                    "streamed_after_finish": self.after_finish, "wrong_length": self.incomplete,
                    "failed_by_disruption": self.failed_by_disruption, "failed_unexpected": self.failed_unexpected,
                    "failure_reasons": dict(self._reasons.most_common(EXAMPLES_KEPT)),
                    "anomalies": list(self._anomalies),
                    "lost_requests": [f"request {n}: {what}" for n, what in
                                      sorted(self._open.items())[:EXAMPLES_KEPT]]}


class EngineLedger:
    """The engine's account through Engine.add_observer: "route" for every routing decision
    (a reroute routes the same id again), "finished" for every finished request. Request ids
    are the engine's "r<N>"; one byte each for routed, one for the times finished."""

    def __init__(self):
        self._lock = threading.Lock()
        self._routed = bytearray()
        self._finished = bytearray()
        self._other: dict[str, list[int]] = {}   # ids of another shape, should the engine change them
        self.reasons: Counter = Counter()    # by finish reason, "error" said "failed" (a report's
        self.by_worker: Counter = Counter()  # "error" key means a part that could not run)

    def observe(self, kind: str, payload) -> None:
        if kind == "route":
            self._mark(payload.request_id, routed=True)
        elif kind == "finished":
            worker, finished = payload
            self._mark(finished.request_id, routed=False)
            with self._lock:
                self.reasons["failed" if finished.reason == "error" else finished.reason] += 1
                self.by_worker[worker] += 1

    def _mark(self, rid: str, routed: bool) -> None:
        with self._lock:
            try:
                n = int(rid[1:])
            except ValueError:
                entry = self._other.setdefault(rid, [0, 0])
                entry[0 if routed else 1] = 1 if routed else entry[1] + 1
                return
            for table in (self._routed, self._finished):
                if len(table) <= n:
                    table.extend(bytes(n + 1 - len(table)))
            if routed:
                self._routed[n] = 1
            elif self._finished[n] < 255:
                self._finished[n] += 1

    def totals(self) -> dict:
        """Routed and finished so far (cheap: for every sample)."""
        with self._lock:
            return {"routed": self._routed.count(1) + sum(r for r, _ in self._other.values()),
                    "finished": len(self._finished) - self._finished.count(0)
                    + sum(1 for _, f in self._other.values() if f)}

    def summary(self) -> dict:
        with self._lock:
            pairs = list(zip(self._routed, self._finished)) + [tuple(v) for v in self._other.values()]
            return {"routed": sum(r for r, _ in pairs),
                    "finished": sum(1 for _, f in pairs if f),
                    "unfinished": sum(1 for r, f in pairs if r and not f),
                    "finished_twice": sum(1 for _, f in pairs if f > 1),
                    "finished_unrouted": sum(1 for r, f in pairs if f and not r),
                    "reasons": dict(self.reasons), "finished_by_worker": {str(k): v for k, v in self.by_worker.items()}}


# --- verdicts ----------------------------------------------------------------------------
def held_pages(page_states: bytes) -> int:
    """Pages some sequence holds, from a worker's page grid (cached prefix pages are not held)."""
    return page_states.count(USED) + page_states.count(SHARED)


def cached_pages(page_states: bytes) -> int:
    return page_states.count(CACHED)


def process_series(samples: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """RSS points per process: "worker1 (pid 4242)" -> [(t, MB)]. A respawned worker or a
    restarted server is a new process, with a series of its own."""
    out: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        for name, mb in s["rss_mb"].items():
            if mb is None:
                continue
            pid = s.get("pids", {}).get(name)
            out.setdefault(f"{name} (pid {pid})" if pid else name, []).append((s["t"], mb))
    return out


def growth(points: list[tuple[float, float]], warmup: float = WARMUP_FRACTION) -> dict:
    """How much a series grew after its warm-up (its first `warmup` of its time span): the
    median of the last quarter of the remaining points against the median of the first
    quarter, so one noisy sample neither hides nor fakes a trend."""
    if not points:
        return {"judged": False, "samples": 0, "why": "no samples"}
    t0, t1 = points[0][0], points[-1][0]
    after = [v for t, v in points if t >= t0 + warmup * (t1 - t0)]
    if len(after) < MIN_JUDGED_SAMPLES:
        return {"judged": False, "samples": len(points),
                "why": f"{len(after)} samples after its warm-up; {MIN_JUDGED_SAMPLES} are needed"}
    q = max(1, len(after) // 4)
    base, end = median(after[:q]), median(after[-q:])
    return {"judged": True, "samples": len(points), "from_s": t0, "to_s": t1, "baseline": round(base, 1),
            "end": round(end, 1), "peak": round(max(after), 1), "growth": round(end - base, 1),
            "growth_pct": round(100.0 * (end - base) / base, 2) if base else None}


def rss_verdict(samples: list[dict], limit_pct: float = RSS_GROWTH_LIMIT_PCT,
                warmup: float = WARMUP_FRACTION) -> dict:
    """Flat resident memory: every process judged grew at most limit_pct after its warm-up.
    This process (the engine, the HTTP server, the clients) must be among those judged."""
    per = {label: growth(points, warmup) for label, points in process_series(samples).items()}
    judged = {k: g for k, g in per.items() if g["judged"]}
    grew = sorted(k for k, g in judged.items() if g["growth_pct"] is None or g["growth_pct"] > limit_pct)
    main_judged = any(k.startswith("main") for k in judged)
    return {"limit_pct": limit_pct, "warmup_fraction": warmup, "processes": per, "grew": grew,
            "ok": main_judged and not grew}


def fd_verdict(samples: list[dict], slack: int = FD_SLACK, warmup: float = WARMUP_FRACTION) -> dict:
    """Open descriptors of this process: at most `slack` more at the end than after warm-up."""
    g = growth([(s["t"], float(s["fds"])) for s in samples if s.get("fds") is not None], warmup)
    return {**g, "slack": slack, "ok": bool(g["judged"]) and g["growth"] <= slack}


def pages_verdict(final: dict) -> dict:
    """No KV page held once the engine is idle: on every local worker (by its page count and by
    its page grid; cached prefix pages have no holder and are not leaks) and on the remote
    server's own worker (its /metrics)."""
    leaked = {name: v for name, v in final["kv"].items() if v["pages_used"] or v["pages_held"]}
    remote = final.get("remote_server_pages_used")
    return {"workers": final["kv"], "remote_server_pages_used": remote, "leaked": leaked,
            "ok": not leaked and remote == 0,
            **({"why": "the remote server's /metrics could not be read"} if remote is None else {})}


def table_verdict(final: dict, keep_finished: int) -> dict:
    """The engine's request table once idle: nothing live, at most the finished ones it keeps."""
    size, live = final["requests_in_table"], final["requests_live"]
    return {"size": size, "live": live, "kept_at_most": keep_finished, "ok": live == 0 and size <= keep_finished}
