"""The facade's flight recorder: its own trace ring, every worker's on request, one trace file.

Always on at light detail unless told otherwise (EngineConfig.trace_detail): each worker
records its steps and counters into a ring bounded by time and memory (engine/trace.py), and
the facade records routing decisions, preemptions and the lifecycle of every request that
ends into its own. `export()` asks each ready worker for a copy of its ring (the workers in
their own processes send it over the event queue), adds the requests still running, and
writes one Perfetto (Chrome JSON) trace of the last window: what the dashboard just showed.

The trace folder keeps at most `trace_keep` of the files it names, and at most `trace_keep_mib`
MiB of them: writing one more deletes the oldest (other files there are never touched). A
caller that asks (`POST /trace`, SIGUSR1) is refused with TraceBusy while a trace is being
written, or sooner after the last than writing it took (at least MIN_TRACE_INTERVAL_S): a
trace holds the last window, so a second one then would repeat the first.
"""
from __future__ import annotations

import math
import os
import re
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from engine import messages as msg
from engine.errors import ConfigError, TokentopError
from engine.facade.requests import RequestRecord, seen_timings
from engine.facade.snapshot import RequestState
from engine.trace import DETAILS, TraceSettings, request_track_events, write_chrome_trace

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.facade.engine_parts import EngineParts

RING_TIMEOUT_S = 10.0     # how long an export waits for the workers' rings
MIN_TRACE_INTERVAL_S = 1.0
# the names write_chrome_trace gives in a folder: the only files pruning deletes
TRACE_FILE = re.compile(r"tokentop-\d{8}-\d{6}-\d{3}(-\d+)?\.json")


class TraceBusy(TokentopError):
    """A trace was asked for while one is being written, or too soon after the last."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = max(1, math.ceil(retry_after))     # whole seconds, for Retry-After


def trace_settings(config: EngineConfig) -> TraceSettings:
    """The recorder's settings from the engine's, checked (a bad value is one line)."""
    detail = config.trace_detail or ("full" if config.trace_dir else "light")
    if detail not in DETAILS:
        raise ConfigError(f"`trace_detail` must be one of {', '.join(DETAILS)}, got {detail!r}")
    if not config.trace_window_s > 0:
        raise ConfigError(f"`trace_window_s` must be more than 0 s, got {config.trace_window_s}; e.g. 120s")
    if config.trace_memory < 1 << 20:
        raise ConfigError(f"`trace_memory` must be at least 1MiB, got {config.trace_memory} bytes; e.g. 64MiB")
    if config.trace_keep < 1 or config.trace_keep_mib < 1:
        raise ConfigError(f"`trace_keep` and `trace_keep_mib` must be at least 1, got {config.trace_keep} "
                          f"and {config.trace_keep_mib}; e.g. 20 and 512")
    return TraceSettings(detail, float(config.trace_window_s), int(config.trace_memory))


def lifecycle(rec: RequestRecord, until: float) -> tuple[str, int | None, list[tuple[str, float]],
                                                          tuple[str, float] | None]:
    """(id, worker, [(phase, start)...], (terminal phase, time) or None) of one request, in
    time.monotonic() seconds: queued -> [waiting-on-leader] -> prefill -> decode -> its end."""
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
    return rec.id, rec.worker, marks, end


class FlightRecorder:
    """Owns the facade's tracer, the detail level every worker records at, and trace export."""

    def __init__(self, engine: EngineParts) -> None:
        self.engine = engine
        self.settings = trace_settings(engine.config)
        self.detail = self.settings.detail
        self.base_detail = "off" if self.detail == "off" else "light"   # what full switches back to
        self.tracer = self.settings.tracer("engine")
        self._since = time.monotonic() if self.detail != "off" else None   # recording since
        self._rings: dict[int, list] = {}
        self._rings_cv = threading.Condition()
        self._writing = threading.Lock()
        self._last_write: tuple[float, float] | None = None     # (ended at, took), time.monotonic()
        engine.add_observer(self._observe)

    def worker_settings(self) -> TraceSettings:
        """What a worker starting now records."""
        return TraceSettings(self.detail, self.settings.window_s, self.settings.max_bytes)

    # --- detail -----------------------------------------------------------------------------
    def set_detail(self, detail: str) -> None:
        if detail not in DETAILS:
            raise ConfigError(f"trace detail must be one of {', '.join(DETAILS)}, got {detail!r}")
        if self.detail == "off" and detail != "off":
            self._since = time.monotonic()
        self.detail = detail
        self.tracer.set_detail(detail)
        for w in self.engine.workers.ready():
            w.send(msg.SetTraceDetail(detail))

    def set_full(self, full: bool) -> None:
        """Full detail (per-layer scopes, NVTX on GPUs), or back to the base detail."""
        self.set_detail("full" if full else self.base_detail)

    # --- what the facade records ------------------------------------------------------------
    def _observe(self, kind: str, payload) -> None:
        if not self.tracer.enabled:
            return
        if kind == "route":
            d = payload
            self.tracer.instant("route", request=d.request_id, chosen=d.chosen, policy=d.policy,
                                reason=d.reason, scores={c.worker: round(c.score, 4) for c in d.candidates},
                                reuse={c.worker: c.cached_tokens for c in d.candidates})
        elif kind == "finished":
            rec = self.engine.requests.get(payload[1].request_id)
            if rec is not None:
                rid, worker, marks, end = lifecycle(rec, time.monotonic())
                self.tracer.request_lifecycle(rid, [(p, int(t * 1e9)) for p, t in marks],
                                              (end[0], int(end[1] * 1e9)), worker=-1 if worker is None else worker)

    def on_ring(self, event: msg.TraceEvents) -> None:
        """A worker's copy of its ring (the dispatcher thread)."""
        with self._rings_cv:
            self._rings[event.worker] = event.events
            self._rings_cv.notify_all()

    # --- export -----------------------------------------------------------------------------
    def export(self, path: str | Path | None = None, timeout: float = RING_TIMEOUT_S, *,
               refuse_busy: bool = False) -> str:
        """Every ready worker's ring, the facade's, and the requests still running, over the
        last window, as one Chrome JSON file; its absolute path. A write error is one line
        and loses nothing: the rings keep their events. Into a folder, the oldest traces
        beyond `trace_keep` / `trace_keep_mib` go. refuse_busy: TraceBusy rather than wait
        for a trace being written, or write one too soon after the last."""
        if not self._writing.acquire(blocking=not refuse_busy):
            took = self._last_write[1] if self._last_write else 1.0
            raise TraceBusy("a trace is being written; ask again when it is done", took)
        try:
            if refuse_busy:
                self._check_interval()
            start = time.monotonic()
            written = self._export(path, timeout)
            self._last_write = (time.monotonic(), time.monotonic() - start)
        finally:
            self._writing.release()
        if not str(path or self.engine.config.trace_dir or "").endswith(".json"):   # into a folder
            self._prune(Path(written).parent, written)
        return written

    def _check_interval(self) -> None:
        if self._last_write is None:
            return
        ended, took = self._last_write
        wait = max(MIN_TRACE_INTERVAL_S, took) - (time.monotonic() - ended)
        if wait > 0:
            raise TraceBusy(f"the last trace was written {time.monotonic() - ended:.1f} s ago and holds "
                            f"the same window; ask again in {math.ceil(wait)} s", wait)

    def _prune(self, folder: Path, keep_path: str) -> None:
        """Delete the oldest trace files in `folder` beyond the count and size caps."""
        config = self.engine.config
        removed = prune_traces(folder, config.trace_keep, config.trace_keep_mib << 20, keep_path)
        if removed:
            self.engine.log("info", f"deleted {removed} older trace{'s' if removed > 1 else ''} in {folder} "
                                    f"(`trace_keep={config.trace_keep}`, `trace_keep_mib={config.trace_keep_mib}`)")

    def _export(self, path: str | Path | None, timeout: float) -> str:
        engine = self.engine
        target = path or engine.config.trace_dir or "traces"
        with engine.lock:
            ready = engine.workers.ready()
        with self._rings_cv:
            self._rings.clear()
        for w in ready:
            w.send(msg.SendTrace())
        deadline = time.monotonic() + timeout
        with self._rings_cv:
            while len(self._rings) < len(ready) and time.monotonic() < deadline:
                self._rings_cv.wait(0.1)
            events = [e for ring in self._rings.values() for e in ring]
            missing = [w.index for w in ready if w.index not in self._rings]
        now = time.monotonic()
        since = now - self.settings.window_s
        if self._since is not None:
            since = max(since, self._since)
        events += self.tracer.ring(since_ns=int(since * 1e9))
        # requests still running: their lifecycle so far, from the facade's records
        with engine.lock:
            live = [lifecycle(r, now) for r in engine.requests.records.values() if r.finish_reason is None]
        events += request_track_events(self.tracer.pid, live, since, now)
        metadata = {"recording": {"detail": self.detail, "window_s": self.settings.window_s,
                                  "max_bytes_per_ring": self.settings.max_bytes,
                                  "covers_s": round(now - since, 3),
                                  "workers_not_answering": missing}}
        try:
            return write_chrome_trace(target, events, metadata=metadata)
        except OSError as exc:
            raise TokentopError(f"cannot write the trace to {Path(target).absolute()}: "
                                f"{exc.strerror or exc}; the recorder keeps its events: "
                                "export again to another folder") from None


def prune_traces(folder: Path, keep: int, keep_bytes: int, spare: str) -> int:
    """Delete the oldest trace files (TRACE_FILE names) in `folder` until at most `keep` of
    them, of at most `keep_bytes` together, remain; `spare` (the one just written) stays
    whatever its size. A file that cannot be deleted is left. How many were deleted."""
    spare = os.path.abspath(spare)
    others, spare_size = [], 0
    try:
        with os.scandir(folder) as entries:
            for e in entries:
                if not TRACE_FILE.fullmatch(e.name) or not e.is_file(follow_symlinks=False):
                    continue
                st = e.stat(follow_symlinks=False)
                if os.path.abspath(e.path) == spare:
                    spare_size = st.st_size
                else:
                    others.append((st.st_mtime, e.name, st.st_size, e.path))
    except OSError:
        return 0
    others.sort(reverse=True)                                 # newest first
    count, size, removed, full = 1, spare_size, 0, False
    for _, _, file_size, file in others:
        full = full or count + 1 > keep or size + file_size > keep_bytes
        if not full:
            count, size = count + 1, size + file_size
            continue
        try:
            os.remove(file)
            removed += 1
        except OSError:
            pass
    return removed
