"""Scopes, counters and request lifecycles → Chrome JSON traces (Perfetto), plus NVTX ranges.

One `Tracer` per worker (its own OS process, or a thread of the main process in tests) and one
for the facade: a flight recorder. It keeps complete spans ("X"), counters ("C"), instants
("i") and per-request phase spans in a ring bounded by time and memory (by default the last
120 s or 64 MiB, whichever is smaller), so pressing `t` writes what just happened. The
worker ships a copy of its ring (`ring()`, plain dicts) to the main process on request,
which writes every worker's ring and its own with `write_chrome_trace()`.

Detail levels (`set_detail`):
    off     nothing is recorded.
    light   the default: engine steps (`span()`), counters, instants (routing decisions,
            preemptions), request lifecycles. Cheap enough to leave on (`tokentop bench trace`).
    full    light plus the deep scopes (`scope()`: model, layer, attn, mlp, qmatmul, ...)
            and, on a tracer made with `nvtx_when_full`, NVTX ranges.

Usage::

    from engine import trace

    tracer = trace.Tracer("worker cpu:0", detail="light")
    trace.set_tracer(tracer)                 # bind to this thread (the worker loop)
    tracer.set_thread_name("loop")           # track name (default: the Python thread name)

    with tracer.span("engine step", step=7):     # recorded at light and full detail
        ...
    # deep code (decoder layers, linear layers) looks the tracer up per call:
    t = trace.get_tracer()
    with t.scope("layer", index=3):              # recorded at full detail only
        with t.scope("qmatmul", op="attention-query"):
            ...
    t.counter("kv_pages", used=118, free=394)
    t.request_phase("r17", "queued")         # closes the previous phase, opens this one
    t.request_phase("r17", "decode")
    t.request_phase("r17", "finished")       # terminal: zero-length span, track closed

    # args and counter values must be plain JSON values (str, int, float, bool, small dicts)

    events = tracer.ring()                   # list[dict], picklable: a copy, the ring stays
    path = trace.write_chrome_trace("traces/", events)   # traces/tokentop-20261129-093012-123.json

Design notes:
- ~Free when off: `scope()` and `span()` check one attribute and return a shared no-op
  context manager (no event, no clock read). At light detail `scope()` stays a no-op.
- Full detail keeps the decoder's one-call decode path (tokentop.DecodeLayers): the call
  takes clock readings around each part of every layer and the decoder records them as the
  same layer/attn/attention/mlp/qmatmul spans with `deep_spans()`. Only NVTX ranges, which
  must be pushed around the code itself, switch it to the per-layer Python path
  (`per_layer`).
- Timestamps: `time.perf_counter_ns()`, which on Linux is clock_gettime(CLOCK_MONOTONIC):
  one system-wide clock (epoch = boot), so traces recorded by different worker processes
  line up without any exchange. Written as float µs with ns precision.
- Tracks: pid is a stable synthetic number derived from the tracer's label (not the OS pid),
  so a worker looks the same in thread mode and process mode; tid is the OS thread id.
  Each request gets its own synthetic track ("req r17"), so overlapping requests never
  break nesting.
- Thread safety: any thread may record. One ring per tracer, behind one lock (uncontended:
  a worker records from its loop thread), so the memory bound is exact and the oldest
  events go first whichever thread recorded them.
- Bounded memory: each record's size is estimated when it is recorded (an upper bound of
  what CPython allocates for it, checked with tracemalloc in tests/test_trace.py); records
  older than the window, or beyond the byte or count budget, leave the ring oldest first.
  Those pushed out by the byte or count budget (not by age) are counted as dropped.
- NVTX: every scope also pushes/pops an NVTX range, coloured per scope name, while NVTX is
  on. The push's return value is never looked at (under Nsight it returns -1 while still
  recording the range, as mini-vllm-rs's post "When 'Just Enable the CUDA Feature' Met Two
  Free GPUs" found with guards that trusted it): the pop runs exactly once, when the wrapped
  code ends, even if it raises. Never uses torch.cuda.nvtx, which raises on CPU builds.
"""
from __future__ import annotations

import json
import os
import tempfile
import threading
import time
import zlib
from collections import deque
from datetime import datetime
from dataclasses import dataclass
from typing import Any, Protocol

_now_ns = time.perf_counter_ns   # CLOCK_MONOTONIC on Linux: shared by all processes

DETAILS = ("off", "light", "full")
DEFAULT_WINDOW_S = 120.0         # the flight recorder keeps this much ...
DEFAULT_MAX_BYTES = 64 * 2**20   # ... or this much memory of it, whichever is smaller
DEFAULT_MAX_EVENTS = 2_000_000
TERMINAL_PHASES = frozenset({"finished", "aborted", "error"})   # engine.snapshot.RequestState
_REQUEST_TID_BASE = 1 << 30      # above any Linux thread id (pid_max <= 2**22)
_DROPPED_MARKER = "tokentop_dropped_events"
_RING_MARKER = "tokentop_ring"
# What CPython allocates for one record, in bytes (measured with tracemalloc, rounded up):
# the record tuple and its ints with no args; an args dict; each value beyond a small int.
_RECORD_BYTES = 240
_ARGS_BYTES = 160
_STR_BYTES = 56
_CONTAINER_BYTES = 240
_ITEM_BYTES = 72


@dataclass(frozen=True)
class TraceSettings:
    """How much a flight recorder keeps (picklable: it travels to worker processes)."""
    detail: str = "light"
    window_s: float = DEFAULT_WINDOW_S
    max_bytes: int = DEFAULT_MAX_BYTES

    def tracer(self, process: str, **kw: Any) -> "Tracer":
        return Tracer(process, detail=self.detail, window_s=self.window_s, max_bytes=self.max_bytes, **kw)

# ARGB colours of the scopes named in the engine; other names get a stable palette colour.
SCOPE_COLORS: dict[str, int] = {
    "model": 0xFF2F6FDE,      # blue
    "layer": 0xFFF28E2B,      # orange
    "attn": 0xFF59A14F,       # green
    "mlp": 0xFF8CD17D,        # light green
    "qmatmul": 0xFFB07AA1,    # purple
    "attention": 0xFF76B7B2,  # teal: the attention kernel itself
    "sampler": 0xFFE15759,    # red
    "scheduler": 0xFF9C755F,  # brown
}
_PALETTE = (0xFF4E79A7, 0xFFEDC948, 0xFFFF9DA7, 0xFFBAB0AC, 0xFF86BCB6, 0xFFD37295)
_color_cache: dict[str, int] = {}


def scope_color(name: str) -> int:
    """ARGB colour of a scope name: fixed for the engine's scopes, stable hash otherwise."""
    color = _color_cache.get(name)
    if color is None:
        color = SCOPE_COLORS.get(name) or _PALETTE[zlib.crc32(name.encode()) % len(_PALETTE)]
        _color_cache[name] = color
    return color


class NvtxBackend(Protocol):
    """What a scope needs from NVTX. Return values are ignored on purpose."""

    def push_range(self, message: str, color: int) -> object: ...
    def pop_range(self) -> object: ...


class NvtxPackageBackend:
    """NVTX through the `nvtx` PyPI package, in the "tokentop" domain.

    Event attributes are cached per (message, colour): messages carry only string
    arguments (see `_nvtx_message`), so the cache stays small.
    """

    def __init__(self, domain: str = "tokentop") -> None:
        import nvtx  # optional at runtime: Tracer(nvtx=True) falls back to no NVTX without it

        self._domain = nvtx.get_domain(domain)   # a no-op domain when no profiler is attached
        self._attributes: dict[tuple[str, int], Any] = {}

    def push_range(self, message: str, color: int) -> None:
        key = (message, color)
        attributes = self._attributes.get(key)
        if attributes is None:
            attributes = self._attributes[key] = self._domain.get_event_attributes(message, color)
        self._domain.push_range(attributes)

    def pop_range(self) -> None:
        self._domain.pop_range()


def _nvtx_message(name: str, args: dict[str, Any]) -> str:
    # Only string args (op=attention-query) go into the label: numbers change every step and
    # would register a new NVTX string each time.
    words = [f"{k}={v}" for k, v in args.items() if isinstance(v, str)]
    return " ".join([name, *words]) if words else name


def synthetic_pid(label: str) -> int:
    """Stable pid for a worker label, identical in every process and run."""
    return zlib.crc32(label.encode()) % 999_983 + 1


class _NoopScope:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


_NOOP_SCOPE = _NoopScope()


class _Scope:
    """One live span. Created per `with`; push in __enter__, pop in __exit__, never earlier."""

    __slots__ = ("_tracer", "_name", "_args", "_start", "_light")

    def __init__(self, tracer: "Tracer", name: str, args: dict[str, Any], light: bool) -> None:
        self._tracer = tracer
        self._name = name
        self._args = args
        self._light = light    # a span() records at light detail; a scope() at full only

    def __enter__(self) -> "_Scope":
        nvtx = self._tracer._nvtx
        if nvtx is not None:
            nvtx.push_range(_nvtx_message(self._name, self._args), scope_color(self._name))
        self._start = _now_ns()   # inside the NVTX range: the span never outlasts it
        return self

    def __exit__(self, *exc: object) -> bool:
        end = _now_ns()
        tracer = self._tracer
        try:
            if tracer._nvtx is not None:
                tracer._nvtx.pop_range()
        finally:
            if tracer.enabled if self._light else tracer.full:
                tracer._emit("X", self._name, self._start, end - self._start, self._args)
        return False


def record_bytes(args: dict[str, Any]) -> int:
    """An upper bound of the memory one record with these args takes in the ring."""
    if not args:
        return _RECORD_BYTES
    n = _RECORD_BYTES + _ARGS_BYTES
    for value in args.values():
        kind = type(value)
        if kind is str:
            n += _STR_BYTES + len(value)
        elif kind is dict or kind is list or kind is tuple:
            n += _CONTAINER_BYTES + _ITEM_BYTES * len(value)
        elif kind is float or (kind is int and not -5 <= value <= 256):   # small ints are shared
            n += 32
    return n


class _Ring:
    """Records (ph, name, ts_ns, dur_ns, args, tid, bytes), oldest first, bounded three ways:
    nothing that ended more than `window_ns` before the newest record, at most `max_bytes`
    of estimated memory, at most `max_events` records. The owner's lock guards it."""

    __slots__ = ("records", "window_ns", "max_bytes", "max_events", "bytes", "dropped", "reported")

    def __init__(self, window_ns: int | None, max_bytes: int | None, max_events: int) -> None:
        self.records: deque[tuple] = deque()
        self.window_ns = window_ns
        self.max_bytes = max_bytes
        self.max_events = max_events
        self.bytes = 0
        self.dropped = 0      # pushed out by the byte or count budget, not by age
        self.reported = 0     # of which drain() has reported

    def append(self, record: tuple) -> None:
        records = self.records
        records.append(record)
        self.bytes += record[6]
        horizon = record[2] + record[3] - self.window_ns if self.window_ns is not None else None
        max_bytes = self.max_bytes
        while records:
            oldest = records[0]
            if horizon is not None and oldest[2] + oldest[3] < horizon:
                pass                                   # aged out: what a window means
            elif (max_bytes is not None and self.bytes > max_bytes) or len(records) > self.max_events:
                self.dropped += 1
            else:
                break
            records.popleft()
            self.bytes -= oldest[6]

    def take(self) -> tuple[list[tuple], int]:
        records = list(self.records)
        self.records.clear()
        self.bytes = 0
        dropped = self.dropped - self.reported
        self.reported = self.dropped
        return records, dropped


class Tracer:
    """Records one worker's (or the facade's) events into its ring.

    detail:     off | light | full (see the module docstring); default full when `enabled`
                (the switch of the older API), else off.
    nvtx:       True to push NVTX ranges through the `nvtx` package (ignored with a warning
                if it cannot be imported), or an object with push_range/pop_range.
    nvtx_when_full: push those ranges at full detail only (a worker: Nsight sees ranges once
                full tracing is switched on); else whenever `nvtx` is given.
    window_s, max_bytes, max_events: the ring's bounds (None: no time / memory bound).
    pid:        track-group id in the trace; defaults to a stable hash of `process`.
    """

    def __init__(self, process: str = "tokentop", *, enabled: bool = False, detail: str | None = None,
                 nvtx: bool | NvtxBackend = False, nvtx_when_full: bool = False,
                 window_s: float | None = DEFAULT_WINDOW_S, max_bytes: int | None = DEFAULT_MAX_BYTES,
                 max_events: int = DEFAULT_MAX_EVENTS, pid: int | None = None) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        if window_s is not None and window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.process = process
        self.pid = synthetic_pid(process) if pid is None else pid
        self.window_s = window_s
        self.max_bytes = max_bytes
        self._nvtx_backend: NvtxBackend | None = _make_nvtx_backend(nvtx)
        self._nvtx_when_full = nvtx_when_full
        self._ring = _Ring(None if window_s is None else int(window_s * 1e9), max_bytes, max_events)
        self._lock = threading.Lock()
        self._local = threading.local()
        self._threads: dict[int, tuple[str, threading.Thread]] = {}   # tid -> track name, thread
        # request_phase(): the open phase of each request (closed by its next phase)
        self._open_requests: dict[str, tuple[str, int, int, dict[str, Any]]] = {}
        self.set_detail(detail or ("full" if enabled else "off"))

    def set_detail(self, detail: str) -> None:
        """Switch what is recorded from now on: off, light or full."""
        if detail not in DETAILS:
            raise ValueError(f"trace detail must be one of {', '.join(DETAILS)}, got {detail!r}")
        self.detail = detail
        self.enabled = detail != "off"          # counters, instants, spans, request phases
        self.full = detail == "full"            # deep scopes too
        self._nvtx = self._nvtx_backend if self.full or not self._nvtx_when_full else None
        self.active = self.full or self._nvtx is not None   # the one flag scope() checks
        self.per_layer = self._nvtx is not None   # NVTX ranges need the decoder's per-layer path
        self._span_live = self.enabled or self._nvtx is not None

    def set_enabled(self, enabled: bool) -> None:
        """Full detail on, or everything off (NVTX given without nvtx_when_full stays on)."""
        self.set_detail("full" if enabled else "off")

    # -- recording -------------------------------------------------------------------------

    def scope(self, name: str, **args: Any) -> _Scope | _NoopScope:
        """Context manager: a deep span on the current thread's track (and an NVTX range),
        recorded at full detail."""
        if not self.active:
            return _NOOP_SCOPE
        return _Scope(self, name, args, False)

    def span(self, name: str, **args: Any) -> _Scope | _NoopScope:
        """Context manager: a span recorded at light detail too (an engine step, not a layer)."""
        if not self._span_live:
            return _NOOP_SCOPE
        return _Scope(self, name, args, True)

    def counter(self, name: str, **values: float) -> None:
        """A counter track per value name, e.g. counter("kv", used=3, free=5)."""
        if self.enabled:
            self._emit("C", name, _now_ns(), 0, values)

    def instant(self, name: str, **args: Any) -> None:
        """A zero-length marker on the current thread's track."""
        if self.enabled:
            self._emit("i", name, _now_ns(), 0, args)

    def deep_spans(self, spans: list[tuple[str, int, int, dict[str, Any]]]) -> None:
        """Deep spans measured elsewhere (name, start ns, duration ns, args), recorded at full
        detail on the current thread's track: the clock readings a C++ call took around its
        parts, as scope() would have recorded them around the same code."""
        if not self.full:
            return
        try:
            tid = self._local.tid
        except AttributeError:
            tid = self._thread_id()
        records = [("X", name, start, dur, args, tid, record_bytes(args)) for name, start, dur, args in spans]
        with self._lock:
            for record in records:
                self._ring.append(record)

    def set_thread_name(self, name: str) -> None:
        """Name the current thread's track (defaults to threading.current_thread().name)."""
        tid = self._thread_id()
        self._threads[tid] = (name, self._threads[tid][1])

    def request_phase(self, request_id: str | int, phase: str, ts_ns: int | None = None,
                      **args: Any) -> None:
        """Request `request_id` enters `phase` at `ts_ns` (perf_counter_ns, default now).

        The previous phase of the request ends at the same instant and becomes one span on
        the request's own track ("req <id>"). A terminal phase (finished / aborted / error)
        is recorded as a zero-length span and closes the track. A `ts_ns` earlier than the
        open phase's start is clamped to it so spans never run backwards.
        """
        if not self.enabled:
            return
        now = _now_ns() if ts_ns is None else ts_ns
        key = str(request_id)
        with self._lock:
            previous = self._open_requests.pop(key, None)
            if previous is None:
                tid = request_tid(key)
            else:
                prev_phase, tid, start, prev_args = previous
                now = max(now, start)
                self._append(("X", prev_phase, start, now - start, prev_args, tid))
            phase_args = {"request": key, **args}
            if phase in TERMINAL_PHASES:
                self._append(("X", phase, now, 0, phase_args, tid))
            else:
                self._open_requests[key] = (phase, tid, now, phase_args)

    def request_lifecycle(self, request_id: str, marks: list[tuple[str, int]],
                          end: tuple[str, int], **args: Any) -> None:
        """A whole lifecycle known once the request has ended: [(phase, start ns)...] and
        (terminal phase, ns), recorded at once on the request's track."""
        if not self.enabled:
            return
        tid = request_tid(request_id)
        args = {"request": request_id, **args}
        with self._lock:
            for phase, start, finish in lifecycle_spans(marks, end[1], None, None):
                self._append(("X", phase, start, finish - start, args, tid))
            self._append(("X", end[0], end[1], 0, args, tid))

    def _emit(self, ph: str, name: str, ts_ns: int, dur_ns: int, args: dict[str, Any]) -> None:
        try:
            tid = self._local.tid
        except AttributeError:
            tid = self._thread_id()
        record = (ph, name, ts_ns, dur_ns, args, tid, record_bytes(args))
        with self._lock:
            self._ring.append(record)

    def _append(self, record: tuple) -> None:   # the lock is held
        self._ring.append((*record, record_bytes(record[4])))

    def _thread_id(self) -> int:
        tid = getattr(self._local, "tid", None)
        if tid is None:
            thread = threading.current_thread()
            tid = self._local.tid = threading.get_native_id()
            self._threads[tid] = (thread.name, thread)
        return tid

    # -- shipping --------------------------------------------------------------------------

    @property
    def ring_bytes(self) -> int:
        """Estimated memory the ring holds now."""
        return self._ring.bytes

    def __len__(self) -> int:
        return len(self._ring.records)

    def ring(self, since_ns: int | None = None) -> list[dict]:
        """A copy of the ring as Chrome trace dicts (plain, picklable); the ring keeps them.

        Holds what ended within the window before now (and at or after `since_ns`), the
        process and track names, and a marker with the ring's bounds and how many records its
        byte or count budget has pushed out since the start.
        """
        now = _now_ns()
        horizon = now - int(self.window_s * 1e9) if self.window_s is not None else None
        if since_ns is not None:
            horizon = since_ns if horizon is None else max(horizon, since_ns)
        with self._lock:
            records = list(self._ring.records)
            ring = self._ring
            marker = {"process": self.process, "detail": self.detail, "window_s": self.window_s,
                      "max_bytes": self.max_bytes, "bytes": ring.bytes, "dropped_total": ring.dropped}
        in_ring = {r[5] for r in records}
        if horizon is not None:
            records = [r for r in records if r[2] + r[3] >= horizon]
        events = self._chrome(records, in_ring)
        events.append({"ph": "M", "name": _RING_MARKER, "pid": self.pid, "tid": 0, "args": marker})
        return events

    def drain(self) -> list[dict]:
        """Take the events recorded so far as Chrome trace dicts, emptying the ring.

        Every batch starts with the process name and the names of its tracks (the writer
        dedupes them), plus a dropped-events marker if records were pushed out by the budget
        since the last drain. Open request phases stay open and come with a later drain.
        """
        with self._lock:
            records, dropped = self._ring.take()
        events = self._chrome(records, set())
        if dropped:
            events.append({"ph": "M", "name": _DROPPED_MARKER, "pid": self.pid, "tid": 0,
                           "args": {"count": dropped, "process": self.process}})
        return events

    def _chrome(self, records: list[tuple], kept: set[int]) -> list[dict]:
        """Chrome dicts of `records`, named; `kept`: tracks that still have records in the ring."""
        pid = self.pid
        names = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": self.process}}]
        named: set[int] = set()
        body = []
        for ph, name, ts_ns, dur_ns, args, tid, _ in records:
            if tid not in named:
                named.add(tid)
                track = f"req {args['request']}" if tid >= _REQUEST_TID_BASE else \
                    self._threads.get(tid, (str(tid),))[0]
                names.append(_thread_name_event(pid, tid, track))
            body.append(_chrome_event(pid, tid, ph, name, ts_ns, dur_ns, args))
        for tid, (_, thread) in list(self._threads.items()):
            if tid not in named and tid not in kept and not thread.is_alive():
                self._threads.pop(tid, None)      # its thread is gone and none of its records is left
        return names + body

    def write(self, path_or_dir: str | os.PathLike) -> str | None:
        """Drain and write this tracer's events; None (and no file) when not recording."""
        if not self.enabled:
            return None
        return write_chrome_trace(path_or_dir, self.drain())


def request_tid(request_id: str) -> int:
    """The synthetic track of a request, the same in every tracer and every export."""
    digits = "".join(ch for ch in request_id if ch.isdigit())
    return _REQUEST_TID_BASE + (int(digits) % (1 << 28) if digits else zlib.crc32(request_id.encode()) % (1 << 20))


def lifecycle_spans(marks: list[tuple[str, Any]], stop: Any, since: Any, until: Any) -> list[tuple[str, Any, Any]]:
    """[(phase, start)...] whose phases end where the next begins and the last at `stop`, as
    (phase, start, end) clipped to [since, until] (None: unclipped); empty spans dropped."""
    bounds = [t for _, t in marks[1:]] + [stop]
    out = []
    for (phase, start), finish in zip(marks, bounds):
        finish = max(finish, start)
        if since is not None:
            start = max(start, since)
        if until is not None:
            finish = min(finish, until)
        if finish > start:
            out.append((phase, start, finish))
    return out


def _thread_name_event(pid: int, tid: int, name: str) -> dict:
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}


def _chrome_event(pid: int, tid: int, ph: str, name: str, ts_ns: int, dur_ns: int,
                  args: dict[str, Any]) -> dict:
    event: dict[str, Any] = {"ph": ph, "name": name, "pid": pid, "tid": tid, "ts": ts_ns / 1000}
    if ph == "X":
        event["dur"] = dur_ns / 1000
    elif ph == "i":
        event["s"] = "t"      # thread-scoped instant
    if args:
        event["args"] = dict(args)
    return event


def request_track_events(pid: int, lifecycles: list[tuple[str, int | None, list[tuple[str, float]],
                                                       tuple[str, float] | None]],
                         since: float, until: float) -> list[dict]:
    """Chrome events for request lifecycles known after the fact, clipped to [since, until].

    Each lifecycle is (request id, worker, [(phase, start time)...], (terminal phase, time)
    or None while it still runs); times are time.monotonic() seconds, which on Linux is the
    clock the tracer uses. A phase ends where the next begins; the last open phase ends at
    `until` with running=True. Each request gets its own track, the same one in every export.
    """
    events: list[dict] = []
    for request_id, worker, marks, end in lifecycles:
        tid = request_tid(request_id)
        stop = end[1] if end is not None else until
        args = {"request": request_id, "worker": -1 if worker is None else worker}
        body = [_chrome_event(pid, tid, "X", phase, int(start * 1e9), int((finish - start) * 1e9), args)
                for phase, start, finish in lifecycle_spans(marks, stop, since, until)]
        if end is not None and since <= end[1] <= until:
            body.append(_chrome_event(pid, tid, "X", end[0], int(end[1] * 1e9), 0, args))
        elif end is None and body:
            body[-1]["args"] = {**args, "running": True}
        if body:
            events.append(_thread_name_event(pid, tid, f"req {request_id}"))
            events += body
    return events


def _make_nvtx_backend(nvtx: bool | NvtxBackend) -> NvtxBackend | None:
    if nvtx is False or nvtx is None:
        return None
    if nvtx is not True:
        return nvtx
    try:
        return NvtxPackageBackend()
    except ImportError:
        import warnings
        warnings.warn("NVTX ranges requested but the nvtx package is not installed "
                      "(pip install nvtx); tracing continues without NVTX.", stacklevel=3)
        return None


# -- current tracer ----------------------------------------------------------------------------

_DISABLED = Tracer("disabled")
_local = threading.local()


def get_tracer() -> Tracer:
    """The tracer bound to this thread, or a shared disabled one."""
    return getattr(_local, "tracer", _DISABLED)


def set_tracer(tracer: Tracer | None) -> Tracer:
    """Bind `tracer` to the current thread (None unbinds); returns the previous one.

    Per thread so that thread-mode workers sharing a process each keep their own tracer;
    a worker binds it once on the thread that runs its loop.
    """
    previous = get_tracer()
    if tracer is None:
        _local.__dict__.pop("tracer", None)
    else:
        _local.tracer = tracer
    return previous


# -- writing and checking ----------------------------------------------------------------------

def check_trace_dir(path_or_dir: str | os.PathLike) -> str:
    """At start-up, before any work: the absolute path, once its folder exists and a file can be
    created in it; else a ConfigError naming the setting (not a traceback after the work is done)."""
    from engine.errors import ConfigError

    path = os.path.abspath(os.fspath(path_or_dir))
    folder = os.path.dirname(path) if path.endswith(".json") else path
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ConfigError(f"`trace_dir={path}`: cannot write a trace there ({exc.strerror or exc}); "
                          "give a folder you can write to") from None
    return path


def write_chrome_trace(path_or_dir: str | os.PathLike, events: list[dict], *,
                       prefix: str = "tokentop", metadata: dict[str, Any] | None = None) -> str:
    """Write events as {"traceEvents", "displayTimeUnit", "metadata"} JSON; return the absolute path.

    A path ending in ".json" is written as given. Anything else is a directory (created if
    needed) and the file is named `<prefix>-YYYYmmdd-HHMMSS-mmm.json`, with a -1, -2, ...
    suffix rather than ever overwriting an existing file.
    """
    names: dict[tuple[Any, Any, str], dict] = {}
    body: list[dict] = []
    dropped: dict[str, int] = {}
    rings: dict[str, dict] = {}     # each flight recorder's bounds and how full it was
    for event in events:
        if event.get("ph") != "M":
            body.append(event)
        elif event["name"] == _DROPPED_MARKER:
            process = event["args"]["process"]
            dropped[process] = dropped.get(process, 0) + event["args"]["count"]
        elif event["name"] == _RING_MARKER:
            rings[event["args"]["process"]] = {k: v for k, v in event["args"].items() if k != "process"}
        else:
            names[(event["pid"], event.get("tid"), event["name"])] = event   # last one wins
    document = {
        "traceEvents": [*names.values(), *body],
        "displayTimeUnit": "ms",
        "metadata": {
            "producer": "tokentop",
            "clock": "CLOCK_MONOTONIC (time.perf_counter_ns), µs since boot, shared by processes",
            # lets a reader map trace timestamps to wall-clock time
            "clock_anchor": {"monotonic_ns": _now_ns(), "unix_ns": time.time_ns()},
            "dropped_events": sum(dropped.values()),
            "dropped_events_by_process": dropped,
            **({"rings": rings} if rings else {}),
            **(metadata or {}),
        },
    }
    path = os.path.abspath(os.fspath(path_or_dir))
    if path.endswith(".json"):
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(document, f, separators=(",", ":"))
        return path
    os.makedirs(path, exist_ok=True)
    now = datetime.now()
    stem = os.path.join(path, f"{prefix}-{now:%Y%m%d-%H%M%S}-{now.microsecond // 1000:03d}")
    candidate, n = f"{stem}.json", 0
    while True:
        try:
            f = open(candidate, "x", encoding="utf-8")   # exclusive create: never overwrite
            break
        except FileExistsError:
            n += 1
            candidate = f"{stem}-{n}.json"
    with f:
        json.dump(document, f, separators=(",", ":"))
    return candidate
