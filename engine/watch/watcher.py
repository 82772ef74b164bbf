"""Several servers over time: tok/s history, latency percentiles, alerts.

* tok/s: the generated-tokens counter's rise between two looks (or the server's own gauge
  where it has no counter); HISTORY of them kept per server.
* TTFT and ITL percentiles: from the histograms' buckets, as Prometheus' histogram_quantile
  computes them (linear within the bucket), over the requests finished since the look
  WINDOW_S ago, or since the server started on the first looks. A tokentop server's /snapshot
  gives its own instead (TTFT, ITL and e2e, nearest rank over its records of the last 60 s, or
  the session when none is that recent), with its workers and its alerts.
* Alerts: down (no answer, or /health not 200), stall (requests running while the generated
  counter has not moved for STALL_S), imbalance (among the watched servers, or a router's
  workers: the busiest has IMBALANCE_MIN more requests than the idlest and IMBALANCE_RATIO
  times as many). A server that a watched router lists as its worker is judged among that
  router's workers only: its load is the router's doing, not comparable to a server beside it.

Every server is looked at in its own thread, each look bounded by its deadline
(engine/watch/sources.py): a slow or hostile server delays no other.
"""
from __future__ import annotations

import math
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import httpx

from engine.watch.sources import TIMEOUT, Sample, look

HISTORY = 60
WINDOW_S = 30.0
STALL_S = 10.0
IMBALANCE_MIN = 4
IMBALANCE_RATIO = 3.0
QUANTILES = (0.5, 0.9, 0.99)
MAX_PARALLEL_LOOKS = 16


@dataclass
class ServerStatus:
    url: str
    kind: str
    state: str                                   # up | down
    error: str = ""
    model: str | None = None
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    tok_s: float | None = None
    tok_s_history: list[float] = field(default_factory=list)
    ttft: dict[str, float | None] = field(default_factory=dict)   # "p50" -> seconds
    itl: dict[str, float | None] = field(default_factory=dict)
    slots: tuple[int, int] | None = None
    requests: float | None = None                # a router: requests routed since it started
    workers: list[dict] = field(default_factory=list)
    alerts: list[str] = field(default_factory=list)
    source: str = "metrics"                      # tokentop: "snapshot" where its /snapshot was read
    note: str = ""                               # why a tokentop server's /snapshot was not read
    e2e: dict[str, float | None] = field(default_factory=dict)       # from /snapshot only
    latency_counts: dict[str, tuple[int, str]] = field(default_factory=dict)   # /snapshot: (n, window)
    engine_workers: list[dict] = field(default_factory=list)   # a tokentop server's workers

    @property
    def load(self) -> float | None:
        if self.running is None and self.waiting is None:
            return None
        return (self.running or 0) + (self.waiting or 0)

    def to_json(self) -> dict:
        return asdict(self)


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """histogram_quantile over cumulative (le, count) buckets; None with no observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le               # above the last finite bucket: its bound
            width = count - prev_count
            return prev_le + (le - prev_le) * ((rank - prev_count) / width if width else 0.0)
        prev_le, prev_count = le, count
    return prev_le


def _delta(now: list[tuple[float, float]], then: list[tuple[float, float]]) -> list[tuple[float, float]]:
    old = dict(then)
    if not then or any(c < old.get(le, 0.0) for le, c in now):    # restarted: counts fell
        return now
    return [(le, c - old.get(le, 0.0)) for le, c in now]


class _Track:
    def __init__(self, url: str):
        self.url = url
        self.looks: deque[Sample] = deque()      # the last WINDOW_S of looks
        self.rates: deque[float] = deque(maxlen=HISTORY)
        self.moved_at: float | None = None       # when the generated counter last rose

    def add(self, s: Sample) -> None:
        last = self.looks[-1] if self.looks else None
        if s.up and last is not None and last.up:
            rate = None
            if s.generated is not None and last.generated is not None and s.at > last.at:
                rate = max(0.0, s.generated - last.generated) / (s.at - last.at)
            elif s.tps_gauge is not None:
                rate = s.tps_gauge
            if rate is not None:
                self.rates.append(rate)
        progressed = (s.generated != last.generated) if s.generated is not None and last is not None \
            else bool(s.tps_gauge)
        if s.up and (self.moved_at is None or last is None or not last.up or progressed):
            self.moved_at = s.at
        self.looks.append(s)
        while len(self.looks) > 2 and s.at - self.looks[0].at > WINDOW_S:
            self.looks.popleft()

    def status(self) -> ServerStatus:
        s = self.looks[-1]
        st = ServerStatus(url=s.url, kind=s.kind, state="up" if s.up else "down", error=s.error, model=s.model,
                          running=s.running, waiting=s.waiting, kv_usage=s.kv, slots=s.slots, workers=s.workers,
                          requests=s.requests, source=s.source, note=s.note, engine_workers=s.engine_workers,
                          tok_s_history=list(self.rates), tok_s=self.rates[-1] if self.rates else None)
        if s.source == "snapshot":
            for name in ("ttft", "itl", "e2e"):
                p = s.percentiles.get(name)
                setattr(st, name, {q: p[q] for q in ("p50", "p95", "p99")} if p else {})
                if p:
                    st.latency_counts[name] = (p["count"], p["window"])
            st.alerts += s.engine_alerts
        base = next((x for x in self.looks if x.up), None)
        for name, attr in (("ttft", "ttft"), ("itl", "itl")) if s.source != "snapshot" else ():
            now = getattr(s, attr)
            window = _delta(now, getattr(base, attr)) if base is not None and base is not s else now
            if window and window[-1][1] <= 0:
                window = now                       # nothing finished in the window: since start
            setattr(st, name, {f"p{round(q * 100)}": quantile(q, window) for q in QUANTILES})
        if not s.up:
            st.alerts.append(f"down: {s.error}" if s.error else "down")
        elif (s.running or 0) > 0 and self.moved_at is not None and s.at - self.moved_at >= STALL_S:
            st.alerts.append(f"stall: {s.running:g} running, no token generated for {s.at - self.moved_at:.0f} s")
        if s.workers:
            down = [w["url"] for w in s.workers if not w["healthy"]]
            if down:
                st.alerts.append("workers down: " + ", ".join(map(str, down)))
            loads = [w["load"] for w in s.workers if w["healthy"] and isinstance(w.get("load"), (int, float))
                     and w["load"] >= 0]
            if _imbalanced(loads):
                st.alerts.append(f"imbalance among its workers: loads {', '.join(f'{x:g}' for x in loads)}")
        return st


def _imbalanced(loads: list[float]) -> bool:
    if len(loads) < 2:
        return False
    hi, lo = max(loads), min(loads)
    return hi - lo >= IMBALANCE_MIN and hi >= IMBALANCE_RATIO * max(lo, 1)


class Watcher:
    """Look at every URL each time poll() is called; status() says what was seen."""

    def __init__(self, urls: list[str], client: httpx.Client | None = None, api_key: str | None = None,
                 timeout: float = TIMEOUT):
        self.urls = [u.rstrip("/") for u in urls]
        self.client = client or httpx.Client()
        self.api_key = api_key             # for tokentop servers' /snapshot
        self.timeout = timeout             # s: one look at one server
        self.tracks = {u: _Track(u) for u in self.urls}
        self._pool = ThreadPoolExecutor(min(len(self.urls), MAX_PARALLEL_LOOKS) or 1,
                                        thread_name_prefix="tokentop-look")

    def poll(self, urls: list[str] | None = None) -> list[ServerStatus]:
        """Look at every server (or those of `urls`) side by side; every server's status."""
        urls = self.urls if urls is None else urls
        samples = self._pool.map(lambda url: look(self.client, url, self.api_key, self.timeout), urls)
        for url, sample in zip(urls, samples):
            self.tracks[url].add(sample)
        return self.status()

    def status(self) -> list[ServerStatus]:
        out = [t.status() for t in self.tracks.values() if t.looks]
        routed = {str(w["url"]).rstrip("/") for s in out if s.kind == "vllm-router" for w in s.workers}
        engines = [s for s in out if s.state == "up" and s.kind != "vllm-router" and s.load is not None
                   and s.url not in routed]
        if _imbalanced([s.load for s in engines]):
            hi = max(engines, key=lambda s: s.load)
            lo = min(engines, key=lambda s: s.load)
            for s in (hi, lo):
                s.alerts.append(f"imbalance: {hi.url} has {hi.load:g} requests, {lo.url} {lo.load:g}")
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
