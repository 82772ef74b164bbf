"""Scopes, counters and request lifecycles → Chrome JSON traces (Perfetto), plus NVTX ranges.

One `Tracer` per worker (its own OS process, or a thread of the main process in tests):
it records complete spans ("X"), counters ("C"), instants ("i") and per-request phase
spans into a bounded in-memory buffer. The worker ships `drain()`ed events (plain dicts)
to the main process, which writes them all with `write_chrome_trace()`.

Usage::

    from engine import trace

    tracer = trace.Tracer("worker cpu:0", enabled=True, nvtx=False)
    trace.set_tracer(tracer)                 # bind to this thread (the worker loop)
    tracer.set_thread_name("loop")           # track name (default: the Python thread name)

    # deep code (decoder layers, linear layers) looks the tracer up per call:
    t = trace.get_tracer()
    with t.scope("layer", index=3):
        with t.scope("qmatmul", op="attention-query"):
            ...
    t.counter("kv_pages", used=118, free=394)
    t.request_phase("r17", "queued")         # closes the previous phase, opens this one
    t.request_phase("r17", "prefill")
    t.request_phase("r17", "decode")
    t.request_phase("r17", "finished")       # terminal: zero-length span, track closed

    # args and counter values must be plain JSON values (str, int, float, bool)

    events = tracer.drain()                  # list[dict], picklable: send over a Queue
    path = trace.write_chrome_trace("traces/", events)   # traces/tokentop-20261129-093012-123.json

Design notes:
- Off by default and ~free when off: `scope()` checks one attribute and returns a shared
  no-op context manager (no event, no clock read).
- Timestamps: `time.perf_counter_ns()`, which on Linux is clock_gettime(CLOCK_MONOTONIC):
  one system-wide clock (epoch = boot), so traces recorded by different worker processes
  line up without any exchange. Written as float µs with ns precision.
- Tracks: pid is a stable synthetic number derived from the tracer's label (not the OS pid),
  so a worker looks the same in thread mode and process mode; tid is the OS thread id.
  Each request gets its own synthetic track ("req r17"), so overlapping requests never
  break nesting.
- Thread safety: any thread may record into a tracer. Each thread appends to its own
  deque (found through a threading.local), and deque.append / popleft are atomic in
  CPython, so recording takes no lock; request phases, which are rare, take one.
- Bounded memory: a ring buffer of `max_events` per recording thread; the oldest events
  are overwritten and the number dropped is reported in the written file's metadata.
- NVTX: with `nvtx=True` every scope also pushes/pops an NVTX range, coloured per scope name.
  The push's return value is never looked at (under Nsight it returns -1 while still
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
from typing import Any, Protocol

_now_ns = time.perf_counter_ns   # CLOCK_MONOTONIC on Linux: shared by all processes

DEFAULT_MAX_EVENTS = 2_000_000
TERMINAL_PHASES = frozenset({"finished", "aborted", "error"})   # engine.snapshot.RequestState
_REQUEST_TID_BASE = 1 << 30      # above any Linux thread id (pid_max <= 2**22)
_DROPPED_MARKER = "tokentop_dropped_events"

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

    __slots__ = ("_tracer", "_name", "_args", "_start")

    def __init__(self, tracer: "Tracer", name: str, args: dict[str, Any]) -> None:
        self._tracer = tracer
        self._name = name
        self._args = args

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
            if tracer.enabled:
                tracer._emit("X", self._name, self._start, end - self._start, self._args)
        return False


class _Buffer:
    """A bounded record list with an exact-enough drop count.

    Only the owner appends and bumps `dropped`; only drain() pops and bumps `reported`, so
    neither needs a lock (deque.append/popleft are atomic in CPython). A drain racing a full
    buffer can over-count one drop.
    """

    __slots__ = ("events", "max_events", "dropped", "reported", "tid", "name", "thread")

    def __init__(self, max_events: int, tid: int, name: str, thread: threading.Thread | None):
        self.events: deque[tuple] = deque(maxlen=max_events)
        self.max_events = max_events
        self.dropped = 0
        self.reported = 0
        self.tid = tid
        self.name = name
        self.thread = thread

    def append(self, record: tuple) -> None:
        if len(self.events) == self.max_events:
            self.dropped += 1     # the deque is about to overwrite its oldest record
        self.events.append(record)

    def take(self) -> tuple[list[tuple], int]:
        """Pop what is there now (never iterate: the owner may be appending) and new drops."""
        events = self.events
        records = [events.popleft() for _ in range(len(events))]
        dropped = self.dropped - self.reported
        self.reported += dropped
        return records, dropped


class Tracer:
    """Records one worker's (or the engine's) events. Disabled unless asked for.

    enabled:    record Chrome trace events.
    nvtx:       True to push NVTX ranges through the `nvtx` package (ignored with a warning
                if it cannot be imported), or an object with push_range/pop_range.
    max_events: ring-buffer size per recording thread; older events beyond it are dropped
                and counted.
    pid:        track-group id in the trace; defaults to a stable hash of `process`.

    Any thread may record: each gets its own buffer (found through a threading.local), so
    the hot path takes no lock. Create the tracer in the process that uses it.
    """

    def __init__(self, process: str = "tokentop", *, enabled: bool = False,
                 nvtx: bool | NvtxBackend = False, max_events: int = DEFAULT_MAX_EVENTS,
                 pid: int | None = None) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self.process = process
        self.pid = synthetic_pid(process) if pid is None else pid
        self.enabled = enabled
        self._nvtx: NvtxBackend | None = _make_nvtx_backend(nvtx)
        self.active = enabled or self._nvtx is not None   # the one flag scope() checks
        self._max_events = max_events
        self._local = threading.local()
        self._buffers: list[_Buffer] = []                  # one per recording thread
        self._buffers_lock = threading.Lock()
        # request phases: low rate, touched from any thread, so one lock guards them
        self._requests = _Buffer(max_events, 0, "requests", None)
        self._requests_lock = threading.Lock()
        self._open_requests: dict[str, tuple[str, int, int, dict[str, Any]]] = {}
        self._request_tracks = 0

    def set_enabled(self, enabled: bool) -> None:
        """Turn Chrome-event recording on or off at run time (NVTX stays as configured)."""
        self.enabled = enabled
        self.active = enabled or self._nvtx is not None

    # -- recording -------------------------------------------------------------------------

    def scope(self, name: str, **args: Any) -> _Scope | _NoopScope:
        """Context manager: a span on the current thread's track (and an NVTX range)."""
        if not self.active:
            return _NOOP_SCOPE
        return _Scope(self, name, args)

    def counter(self, name: str, **values: float) -> None:
        """A counter track per value name, e.g. counter("kv", used=3, free=5)."""
        if self.enabled:
            self._emit("C", name, _now_ns(), 0, values)

    def instant(self, name: str, **args: Any) -> None:
        """A zero-length marker on the current thread's track."""
        if self.enabled:
            self._emit("i", name, _now_ns(), 0, args)

    def set_thread_name(self, name: str) -> None:
        """Name the current thread's track (defaults to threading.current_thread().name)."""
        self._thread_buffer().name = name

    def request_phase(self, request_id: str | int, phase: str, ts_ns: int | None = None,
                      **args: Any) -> None:
        """Request `request_id` enters `phase` at `ts_ns` (perf_counter_ns, default now).

        The previous phase of the request ends at the same instant and becomes one span on
        the request's own track ("req <id>"). A terminal phase (finished / aborted / failed)
        is recorded as a zero-length span and closes the track. A `ts_ns` earlier than the
        open phase's start is clamped to it so spans never run backwards.
        """
        if not self.enabled:
            return
        now = _now_ns() if ts_ns is None else ts_ns
        key = str(request_id)
        with self._requests_lock:
            previous = self._open_requests.pop(key, None)
            if previous is None:
                tid = _REQUEST_TID_BASE + self._request_tracks
                self._request_tracks += 1
            else:
                prev_phase, tid, start, prev_args = previous
                now = max(now, start)
                self._requests.append(("X", prev_phase, start, now - start, prev_args, tid))
            phase_args = {"request": key, **args}
            if phase in TERMINAL_PHASES:
                self._requests.append(("X", phase, now, 0, phase_args, tid))
            else:
                self._open_requests[key] = (phase, tid, now, phase_args)

    def _emit(self, ph: str, name: str, ts_ns: int, dur_ns: int, args: dict[str, Any]) -> None:
        try:
            buffer = self._local.buffer
        except AttributeError:
            buffer = self._thread_buffer()
        buffer.append((ph, name, ts_ns, dur_ns, args))

    def _thread_buffer(self) -> _Buffer:
        buffer = getattr(self._local, "buffer", None)
        if buffer is None:
            thread = threading.current_thread()
            buffer = self._local.buffer = _Buffer(self._max_events, threading.get_native_id(),
                                                  thread.name, thread)
            with self._buffers_lock:
                self._buffers.append(buffer)
        return buffer

    # -- shipping --------------------------------------------------------------------------

    def drain(self) -> list[dict]:
        """Take the events recorded so far as Chrome trace dicts (plain, picklable).

        Every batch starts with the process name and the names of its tracks (the writer
        dedupes them), plus a dropped-events marker if a buffer overflowed since the last
        drain. Open request phases stay open and come with a later drain.
        """
        pid = self.pid
        names = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                  "args": {"name": self.process}}]
        body: list[dict] = []
        dropped = 0
        with self._buffers_lock:
            buffers = list(self._buffers)
        for buffer in buffers:
            records, lost = buffer.take()
            dropped += lost
            if records:
                names.append(_thread_name_event(pid, buffer.tid, buffer.name))
            body += [_chrome_event(pid, buffer.tid, *record) for record in records]
            if not buffer.thread.is_alive() and not buffer.events:
                with self._buffers_lock:
                    self._buffers.remove(buffer)   # its thread is gone: nothing more will come
        with self._requests_lock:
            records, lost = self._requests.take()
        dropped += lost
        named: set[int] = set()
        for ph, name, ts_ns, dur_ns, args, tid in records:
            if tid not in named:
                named.add(tid)
                names.append(_thread_name_event(pid, tid, f"req {args['request']}"))
            body.append(_chrome_event(pid, tid, ph, name, ts_ns, dur_ns, args))
        if dropped:
            names.append({"ph": "M", "name": _DROPPED_MARKER, "pid": pid, "tid": 0,
                          "args": {"count": dropped, "process": self.process}})
        return names + body

    def write(self, path_or_dir: str | os.PathLike) -> str | None:
        """Drain and write this tracer's events; None (and no file) when not recording."""
        if not self.enabled:
            return None
        return write_chrome_trace(path_or_dir, self.drain())


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
        digits = "".join(ch for ch in request_id if ch.isdigit())
        tid = _REQUEST_TID_BASE + (int(digits) if digits else zlib.crc32(request_id.encode()) % (1 << 20))
        stop = end[1] if end is not None else until
        bounds = [t for _, t in marks[1:]] + [stop]
        args = {"request": request_id, "worker": -1 if worker is None else worker}
        body = []
        for (phase, start), finish in zip(marks, bounds):
            start, finish = max(start, since), min(max(finish, start), until)
            if finish > start:
                body.append(_chrome_event(pid, tid, "X", phase, int(start * 1e9),
                                          int((finish - start) * 1e9), args))
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
    for event in events:
        if event.get("ph") != "M":
            body.append(event)
        elif event["name"] == _DROPPED_MARKER:
            process = event["args"]["process"]
            dropped[process] = dropped.get(process, 0) + event["args"]["count"]
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
