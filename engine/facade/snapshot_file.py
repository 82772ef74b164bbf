"""Recordings of what the dashboard shows: the snapshot stream on disk, and read back.

`SnapshotRecorder` takes `engine.snapshot()` five times a second (`--record FILE`) and writes
each as the difference from the one before; `read_recording()` gives them back as the same
EngineSnapshot objects, frame by frame, for `tokentop replay`.

File: a gzip stream (stdlib: no dependency, readable with zcat, and flushed after every frame
so a recording stays readable up to its last frame) of JSON lines:
    1. the header: {"format": "tokentop-recording", "version", "started" (unix s), "interval_s",
       "workers": [WorkerConfig fields...], "command"}
    2. one line per frame: {"t": seconds since start, "top": {changed top-level fields},
       "w" | "r" | "d" | "l" | "tl" | "h": changes to the workers, requests, routing decisions,
       log lines, request timelines, per-worker history (the `h` charts' points)}
       where a collection's change is {"s": {key: changed fields}, "n": [new keys, in order],
       "x": [removed keys], "o": [every key, only when the order changed otherwise]}, and a
       changed field whose text or list only slid (a request's text tail, a sparkline's
       history) is written "~field": [items dropped from the front, items added at the end]
    3. {"end": frames}: written when the recorder stops; without it the file was cut short.
Floats are kept to 4 decimals (0.1 ms of a latency, 0.0001 tok/s), a request's age as the
time it was born (it changes every frame, its birth does not), KV page states run-length
encoded. The replay shows exactly what the file holds, so a position always shows the same
frame.
"""
from __future__ import annotations

import bisect
import dataclasses
import gzip
import json
import os
import threading
import time
import types
import typing
import zlib
from enum import Enum
from typing import Any

from engine.config import WorkerConfig
from engine.errors import ConfigError, TokentopError
from engine.facade.alerts import Alert
from engine.facade.history import SERIES, History
from engine.facade.latency import LatencyView
from engine.facade.snapshot import EngineSnapshot, LogLine, RequestView, WorkerView
from engine.facade.timeline import Timeline
from engine.facade.router import RouteDecision

FORMAT = "tokentop-recording"
VERSION = 1
INTERVAL_S = 0.2          # five frames a second, as often as the dashboard refreshes
CHECKPOINT_EVERY = 250    # frames between the states a reader keeps for seeking
COLLECTIONS = {"w": "workers", "r": "requests", "d": "routing", "l": "log", "tl": "timelines", "h": "history"}
TOP_FIELDS = ("router_policy", "tracing", "uptime", "trace_detail")


class RecordingError(TokentopError):
    """A file that is not a tokentop recording, or one cut short or damaged."""
    cut_short = False   # frames before the cut can still be played (read_recording's partial)


# --- values <-> JSON ---------------------------------------------------------------------------
def plain(value: Any) -> Any:
    """A snapshot value as JSON: dataclasses as dicts, tuples as lists, floats to 4 decimals."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, float):
        return round(value, 4)
    if dataclasses.is_dataclass(value):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, bytes):
        return run_lengths(value)
    return value


def run_lengths(data: bytes) -> list[int]:
    """b"\\x01\\x01\\x00" -> [1, 2, 0, 1]: (value, count) pairs, flat."""
    out: list[int] = []
    for b in data:
        if out and out[-2] == b:
            out[-1] += 1
        else:
            out += [b, 1]
    return out


def from_run_lengths(pairs: list[int]) -> bytes:
    return b"".join(bytes([pairs[i]]) * pairs[i + 1] for i in range(0, len(pairs), 2))


_HINTS: dict[type, dict[str, Any]] = {}


def build(cls: type, data: dict) -> Any:
    """A dataclass from plain(): fields typed by its annotations; unknown keys ignored,
    missing ones left at their defaults (a file from another version still reads)."""
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    kwargs = {f.name: typed(hints[f.name], data[f.name]) for f in dataclasses.fields(cls) if f.name in data}
    return cls(**kwargs)


def typed(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        kinds = [a for a in args if a is not type(None)]
        return typed(kinds[0], value) if len(kinds) == 1 else value
    if hint is bytes:
        return from_run_lengths(value)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(typed(args[0], v) for v in value)
        return tuple(typed(a, v) for a, v in zip(args, value)) if args else tuple(value)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return build(hint, value)
    if origin is dict and len(args) == 2:   # JSON keys are strings: an int key comes back as one
        key = int if args[0] is int else (lambda k: k)
        return {key(k): typed(args[1], v) for k, v in value.items()}
    return value


# --- a snapshot as a state of keyed collections ------------------------------------------------
def history_fields(h: History) -> dict:
    """A worker's history as flat lists (times and each series), so a new second's point is
    written as a slide of each list, not the whole history again."""
    return {"times": plain(h.times), **{name: plain(h.values(name)) for name in SERIES}}


def snapshot_state(snap: EngineSnapshot, t: float, spec_mode: str = "",
                   history_cache: dict | None = None) -> dict:
    """One frame: the snapshot's fields, each collection keyed so frames can be diffed.
    `history_cache` (worker -> (History, its fields)) spares converting a history again: it
    changes once a second, frames come five times a second."""
    history = {}
    for index, h in snap.history.items():
        cached = history_cache.get(index) if history_cache is not None else None
        if cached is None or cached[0] is not h:
            cached = (h, history_fields(h))
            if history_cache is not None:
                history_cache[index] = cached
        history[str(index)] = cached[1]
    requests = {}
    for r in snap.requests:
        fields = plain(r)
        fields["born"] = round(t - fields.pop("age"), 2)
        requests[r.id] = fields
    top = {**{name: plain(getattr(snap, name)) for name in TOP_FIELDS}, "spec_mode": spec_mode,
           "clock": round(snap.clock, 3),
           "latency": {name: plain(view) for name, view in snap.latency.items()},
           "alerts": plain(snap.alerts),
           "alert_counts": [[kind, worker, n] for (kind, worker), n in snap.alert_counts.items()]}
    return {
        "t": round(t, 3),
        "top": top,
        "w": _keyed({str(w.index): plain(w) for w in snap.workers}),
        "r": _keyed(requests),
        "d": _keyed({f"{d.request_id}@{d.time:.6f}": plain(d) for d in snap.routing}),
        "l": _keyed({_log_key(line): plain(line) for line in snap.log}),
        "tl": _keyed({rid: plain(tl) for rid, tl in snap.timelines.items()}),
        "h": _keyed(history),
    }


def _log_key(line: LogLine) -> str:
    return f"{line.time:.6f}:{zlib.crc32(f'{line.level}{line.text}'.encode()):08x}"


def _keyed(items: dict) -> dict:
    return {"keys": list(items), "items": items}


def empty_state() -> dict:
    return {"t": 0.0, "top": {}, **{c: _keyed({}) for c in COLLECTIONS}}


def state_snapshot(state: dict, started: float) -> tuple[EngineSnapshot, str]:
    """A frame's state back as the EngineSnapshot the engine gave, and the speculation mode."""
    t = state["t"]
    requests = []
    for key in state["r"]["keys"]:
        fields = dict(state["r"]["items"][key])
        fields["age"] = max(0.0, round(t - fields.pop("born"), 2))
        requests.append(build(RequestView, fields))
    top = state["top"]
    snap = EngineSnapshot(
        time=started + t,
        workers=tuple(build(WorkerView, state["w"]["items"][k]) for k in state["w"]["keys"]),
        requests=tuple(requests),
        routing=tuple(build(RouteDecision, state["d"]["items"][k]) for k in state["d"]["keys"]),
        router_policy=top.get("router_policy", ""),
        log=tuple(build(LogLine, state["l"]["items"][k]) for k in state["l"]["keys"]),
        tracing=bool(top.get("tracing", False)), uptime=top.get("uptime", 0.0),
        trace_detail=top.get("trace_detail", "light"), clock=top.get("clock", 0.0),
        latency={name: build(LatencyView, v) for name, v in top.get("latency", {}).items()},
        alerts=tuple(build(Alert, a) for a in top.get("alerts", ())),
        alert_counts={(kind, worker): n for kind, worker, n in top.get("alert_counts", ())},
        timelines={k: build(Timeline, state["tl"]["items"][k]) for k in state["tl"]["keys"]},
        history={int(k): _history(state["h"]["items"][k]) for k in state["h"]["keys"]})
    return snap, top.get("spec_mode", "")


def _history(fields: dict) -> History:
    return History(tuple(fields["times"]), {name: tuple(fields.get(name, ())) for name in SERIES})


# --- differences between frames ----------------------------------------------------------------
_SLIDE_MIN = 24    # texts and lists shorter than this are written whole


def slide(old: Any, new: Any) -> list | None:
    """[k, tail] with new == old[k:] + tail and the overlap not empty, or None."""
    n = len(old)
    if not n or not new:
        return None
    if isinstance(old, str):
        k = old.find(new[0])
        while k != -1:        # only where old has new's first character can the overlap start
            if new.startswith(old[k:]):
                tail = new[n - k:]
                return [k, tail] if len(tail) < len(new) else None
            k = old.find(new[0], k + 1)
        return None
    for k in range(n):
        if new[:n - k] == old[k:]:
            tail = new[n - k:]
            return [k, tail] if len(tail) < len(new) else None
    return None


def fields_delta(old: dict, new: dict) -> dict:
    out = {}
    for name, value in new.items():
        before = old.get(name)
        if before == value and name in old:
            continue
        if type(before) is type(value) and isinstance(value, (str, list)) and len(value) >= _SLIDE_MIN:
            moved = slide(before, value)
            if moved is not None:
                out["~" + name] = moved
                continue
        out[name] = value
    return out


def apply_fields(fields: dict, delta: dict) -> None:
    for name, value in delta.items():
        if name[0] == "~":
            name = name[1:]
            k, tail = value
            fields[name] = fields[name][k:] + tail
        else:
            fields[name] = value


def state_delta(old: dict, new: dict) -> dict:
    """What turns frame `old` into frame `new` (the file's frame line)."""
    out: dict[str, Any] = {"t": new["t"]}
    top = fields_delta(old["top"], new["top"])
    if top:
        out["top"] = top
    for c in COLLECTIONS:
        before, after = old[c], new[c]
        items, old_items = after["items"], before["items"]
        removed = [k for k in before["keys"] if k not in items]
        added = [k for k in after["keys"] if k not in old_items]
        changes: dict[str, Any] = {}
        changed = {}
        for k in after["keys"]:
            if k in old_items:
                d = fields_delta(old_items[k], items[k])
                if d:
                    changed[k] = d
            else:
                changed[k] = items[k]
        if changed:
            changes["s"] = changed
        if added:
            changes["n"] = added
        if removed:
            changes["x"] = removed
        kept = [k for k in before["keys"] if k in items]
        if kept + added != after["keys"]:
            changes["o"] = after["keys"]
        if changes:
            out[c] = changes
    return out


def apply_delta(state: dict, delta: dict) -> None:
    """Frame line `delta` onto `state` (in place)."""
    state["t"] = delta["t"]
    if "top" in delta:
        apply_fields(state["top"], delta["top"])
    for c in COLLECTIONS:
        changes = delta.get(c)
        if not changes:
            continue
        keys, items = state[c]["keys"], state[c]["items"]
        new = changes.get("n", ())
        for k in changes.get("x", ()):
            del items[k]
        for k, fields in changes.get("s", {}).items():
            if k in new:
                items[k] = dict(fields)
            else:
                apply_fields(items[k], fields)
        if "o" in changes:
            state[c]["keys"] = list(changes["o"])
        else:
            gone = set(changes.get("x", ()))
            state[c]["keys"] = [k for k in keys if k not in gone] + list(new)


# --- writing -----------------------------------------------------------------------------------
class SnapshotRecorder:
    """Writes the engine's snapshots to `path` from a thread, until close()."""

    def __init__(self, engine, path: str | os.PathLike, *, interval: float = INTERVAL_S,
                 command: list[str] | None = None, started: float | None = None) -> None:
        self.engine = engine
        self.path = os.path.abspath(os.fspath(path))
        self.interval = interval
        try:   # checked now, before any work: not a traceback at the end of the run
            self._file = gzip.open(self.path, "wt", encoding="utf-8", compresslevel=6)
        except OSError as exc:
            raise ConfigError(f"{path}: cannot write a recording there ({exc.strerror or exc}); "
                              "give a file in a folder you can write to") from None
        self.started = time.time() if started is None else started   # frame times count from here
        self.frames = 0
        self.error: str | None = None
        self._state = empty_state()
        self._history: dict = {}     # snapshot_state's history_cache
        self._stop = threading.Event()
        self._lock = threading.Lock()
        header = {"format": FORMAT, "version": VERSION, "started": self.started, "interval_s": interval,
                  "workers": [dataclasses.asdict(w) for w in engine.config.workers],
                  "command": command or []}
        self._write_line(header)
        self._thread = threading.Thread(target=self._run, name="tokentop-record", daemon=True)

    def start(self) -> "SnapshotRecorder":
        self._thread.start()
        return self

    def record(self) -> None:
        """Write one frame now (the thread calls this at every interval)."""
        snap = self.engine.snapshot()
        state = snapshot_state(snap, snap.time - self.started, self.engine.spec_mode, self._history)
        with self._lock:
            if self._file is None:
                return
            self._write_line(state_delta(self._state, state))
            self._state = state
            self.frames += 1

    def _write_line(self, obj: dict) -> None:
        self._file.write(json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n")
        self._file.flush()     # a sync flush: what is written stays readable if the process dies

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                self.record()
            except OSError as exc:   # e.g. the disk filled up: say so once, keep serving
                self.error = f"recording to {self.path} stopped: {exc.strerror or exc}"
                self.engine.log("error", self.error)
                return
            next_at += self.interval
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def close(self) -> None:
        """Stop, write the end marker, close the file. Safe to call twice."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        with self._lock:
            if self._file is None:
                return
            try:
                if self.error is None:
                    self._write_line({"end": self.frames})
                self._file.close()
            except OSError:
                pass
            self._file = None


# --- reading -----------------------------------------------------------------------------------
class Recording:
    """A recording read back: `len(rec)` frames at `times`; `frame(i)` is frame i as an
    EngineSnapshot (and the speculation mode of that moment)."""

    def __init__(self, path: str, header: dict, lines: list[str], complete: bool) -> None:
        self.path = path
        self.header = header
        self.started = float(header.get("started", 0.0))
        self.complete = complete
        self.workers = tuple(build(WorkerConfig, w) for w in header.get("workers", ()))
        self._lines = lines
        self.times: list[float] = []
        self._checkpoints: list[str] = []      # JSON of every CHECKPOINT_EVERY-th state
        state = empty_state()
        for i, line in enumerate(lines):
            try:
                apply_delta(state, json.loads(line))
            except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
                raise RecordingError(f"{path}: frame {i + 1} is damaged ({type(exc).__name__}: {exc}); "
                                     "the recording cannot be played past it") from None
            self.times.append(state["t"])
            if i % CHECKPOINT_EVERY == 0:
                self._checkpoints.append(json.dumps(state))
        self._at = -1
        self._state: dict | None = None

    def __len__(self) -> int:
        return len(self.times)

    @property
    def duration(self) -> float:
        return self.times[-1] if self.times else 0.0

    def index_at(self, position: float) -> int:
        """The frame shown at `position` seconds: the last one at or before it."""
        return max(0, bisect.bisect_right(self.times, position) - 1)

    def state(self, index: int) -> dict:
        if self._state is None or index < self._at or index - self._at > CHECKPOINT_EVERY:
            base = index // CHECKPOINT_EVERY
            self._state, self._at = json.loads(self._checkpoints[base]), base * CHECKPOINT_EVERY
        while self._at < index:
            self._at += 1
            apply_delta(self._state, json.loads(self._lines[self._at]))
        return self._state

    def frame(self, index: int) -> tuple[EngineSnapshot, str]:
        return state_snapshot(self.state(index), self.started)


def read_recording(path: str | os.PathLike, *, partial: bool = False) -> Recording:
    """Read a recording; a file that is not one, or one cut short (unless `partial`: then
    its complete frames), is a one-line RecordingError."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise RecordingError(f"{path}: no such file") from None
    except OSError as exc:
        raise RecordingError(f"cannot read {path}: {exc.strerror or exc}") from None
    if raw[:2] != b"\x1f\x8b":
        raise RecordingError(f"{path} is not a tokentop recording (not a gzip stream); "
                             "the dashboard and `tokentop serve` write one when asked to record")
    # zlib rather than gzip.open: a stream cut short still gives everything before the cut
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
    data = bytearray()
    cut = None
    try:
        for at in range(0, len(raw), 1 << 16):
            data += inflate.decompress(raw[at:at + (1 << 16)])
    except zlib.error:
        cut = "its compressed stream is damaged"
    if cut is None and not inflate.eof:
        cut = "its compressed stream ends early"
    lines = data.decode("utf-8", errors="replace").split("\n")
    try:
        header = json.loads(lines[0])
        assert isinstance(header, dict) and header.get("format") == FORMAT
    except (ValueError, AssertionError):
        raise RecordingError(f"{path} is not a tokentop recording (no tokentop-recording header); "
                             "the dashboard and `tokentop serve` write one when asked to record") from None
    if not isinstance(header.get("version"), int) or header["version"] > VERSION:
        raise RecordingError(f"{path} is a recording of format {header.get('version')!r}; this tokentop reads "
                             f"format {VERSION} and older: replay it with a newer tokentop")
    body = lines[1:]
    if body and body[-1] == "":
        body.pop()                      # after the last newline
    elif body:
        body.pop()                      # a line cut in the middle
        cut = cut or "its last line is cut in the middle"
    complete = False
    if body and body[-1].startswith('{"end":'):
        body.pop()
        complete = cut is None
    elif cut is None:
        cut = "the recorder did not finish it"
    if cut is not None and not partial:
        seconds = _last_time(body)
        error = RecordingError(f"{path} is cut short after {len(body)} frames ({seconds:.1f} s): {cut}; "
                               "the frames before the cut can be played")
        error.cut_short = True
        raise error
    if not body:
        raise RecordingError(f"{path} holds no frames")
    return Recording(path, header, body, complete)


def _last_time(lines: list[str]) -> float:
    for line in reversed(lines):
        try:
            return float(json.loads(line)["t"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0.0
