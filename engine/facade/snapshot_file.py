"""Recordings of what the dashboard shows: the snapshot stream on disk, and read back.

`SnapshotRecorder` takes `engine.snapshot()` five times a second (`--record FILE`) and writes
each as the difference from the one before; engine/facade/recording_read.py gives them back
as the same EngineSnapshot objects, frame by frame, for `tokentop replay`.

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
from typing import Any, Callable

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
MAX_PAGES = 1 << 24       # KV pages a worker's page_states may expand to (16 MiB)
MAX_NUMBER = 1e15         # a float read back: a unix time in µs fits, so sums and traces stay finite
MAX_INTEGER = 2 ** 64     # an integer read back (a seed may use all 64 bits)
MAX_SLID = 1 << 16        # a text or list read back as a slide (a text tail, a chart's points)
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


def from_run_lengths(pairs: list[int], limit: int = MAX_PAGES) -> bytes:
    """The bytes of run_lengths(); a ValueError for anything else, and before expanding
    anything if the runs add up to more than `limit` bytes."""
    if not isinstance(pairs, list) or len(pairs) % 2:
        raise ValueError("page_states must be a list of (state, count) pairs")
    if not all(type(n) is int for n in pairs):
        raise ValueError("page_states must hold integers")
    values, counts = pairs[0::2], pairs[1::2]
    if any(not 0 <= v <= 255 for v in values) or any(n < 0 for n in counts):
        raise ValueError("page_states holds a state outside 0..255 or a negative count")
    if sum(counts) > limit:
        raise ValueError(f"page_states counts {sum(counts):,} pages, more than the {limit:,} declared")
    return b"".join(bytes([v]) * n for v, n in zip(values, counts))


# JSON types a field of each plain hint accepts (bool is an int to Python: kept apart)
_LEAVES: dict[Any, tuple[type, ...]] = {str: (str,), bool: (bool,), int: (int,), float: (int, float),
                                        dict: (dict,), list: (list,)}
_FIELDS: dict[type, list[tuple[str, Callable]]] = {}     # a dataclass's fields and their converters
_CONVERTERS: dict[Any, Callable] = {}                     # a type hint's converter


def build(cls: type, data: dict) -> Any:
    """A dataclass from plain(): fields typed by its annotations; unknown keys ignored,
    missing ones left at their defaults (a file from another version still reads). A value
    of the wrong type is a TypeError naming the field."""
    if not isinstance(data, dict):
        raise TypeError(f"{cls.__name__} must be an object, not {type(data).__name__}")
    fields = _FIELDS.get(cls)
    if fields is None:
        hints = typing.get_type_hints(cls)
        fields = _FIELDS[cls] = [(f.name, converter(hints[f.name])) for f in dataclasses.fields(cls)]
    return cls(**{name: convert(data[name], name) for name, convert in fields if name in data})


def typed(hint: Any, value: Any, name: str = "value") -> Any:
    """`value` (from JSON) as `hint` says: checked, tuples made of lists, dataclasses built."""
    return converter(hint)(value, name)


def converter(hint: Any) -> Callable[[Any, str], Any]:
    """The function (value, field name) -> value typed as `hint`, made once per hint."""
    made = _CONVERTERS.get(hint)
    if made is None:
        made = _CONVERTERS[hint] = _make_converter(hint)
    return made


def _make_converter(hint: Any) -> Callable[[Any, str], Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        kinds = [a for a in args if a is not type(None)]
        if len(kinds) != 1:
            return lambda value, name: value
        inner, optional = converter(kinds[0]), type(None) in args
        return lambda value, name: None if value is None and optional else inner(value, name)
    if hint in _LEAVES:
        return _leaf(hint)
    if hint is bytes:
        return lambda value, name: from_run_lengths(value)
    if origin is tuple:
        return _tuple(args)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return lambda value, name: build(hint, value)
    if origin is dict and len(args) == 2:   # JSON keys are strings: an int key comes back as one
        key, inner = (int if args[0] is int else str), converter(args[1])

        def mapping(value, name):
            _need(value, dict, name)
            return {key(k): inner(v, name) for k, v in value.items()}
        return mapping
    return lambda value, name: value


def _need(value: Any, kind: type, name: str) -> None:
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be {'a list' if kind is list else 'an object'}, not {type(value).__name__}")


def _leaf(hint: type) -> Callable[[Any, str], Any]:
    accepted, no_bool = _LEAVES[hint], hint is not bool
    bound = MAX_NUMBER if hint is float else MAX_INTEGER if hint is int else None

    def leaf(value, name):
        if not isinstance(value, accepted) or (no_bool and isinstance(value, bool)):
            raise TypeError(f"{name} must be {hint.__name__}, not {type(value).__name__}")
        if bound is not None and not -bound <= value <= bound:     # NaN fails both
            raise ValueError(f"{name} is out of range ({str(value)[:24]})")
        return value
    return leaf


def _tuple(args: tuple) -> Callable[[Any, str], Any]:
    if len(args) == 2 and args[1] is Ellipsis:
        inner = converter(args[0])

        def each(value, name):
            _need(value, list, name)
            return tuple(inner(v, name) for v in value)
        return each
    inners = [converter(a) for a in args]

    def fixed(value, name):
        _need(value, list, name)
        if inners and len(value) != len(inners):
            raise TypeError(f"{name} must be a list of {len(inners)}, not of {len(value)}")
        return tuple(inner(v, name) for inner, v in zip(inners, value)) if inners else tuple(value)
    return fixed


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
    parts = {name: tuple(ITEMS[c](state[c]["items"][k], t) for k in state[c]["keys"])
             for c, name in COLLECTIONS.items() if name not in ("timelines", "history")}
    top = state["top"]
    snap = EngineSnapshot(
        time=started + t, **parts, **top_fields(top),
        timelines={k: ITEMS["tl"](state["tl"]["items"][k], t) for k in state["tl"]["keys"]},
        history={int(k): ITEMS["h"](state["h"]["items"][k], t) for k in state["h"]["keys"]})
    return snap, top.get("spec_mode", "")


_TOP_HINTS = {"router_policy": str, "tracing": bool, "uptime": float, "trace_detail": str, "clock": float}
_TOP_DEFAULTS = {"router_policy": "", "tracing": False, "uptime": 0.0, "trace_detail": "light", "clock": 0.0}


def top_fields(top: dict, only: dict | None = None) -> dict:
    """A frame's top-level fields as EngineSnapshot's keyword arguments (types checked);
    with `only`, just those it names (the fields a frame changed)."""
    def wanted(name: str) -> bool:
        return only is None or name in only or "~" + name in only
    fields = {name: typed(hint, top.get(name, _TOP_DEFAULTS[name]), name)
              for name, hint in _TOP_HINTS.items() if wanted(name)}
    typed(str, top.get("spec_mode", ""), "spec_mode")
    if wanted("latency"):
        fields["latency"] = typed(dict[str, LatencyView], top.get("latency", {}), "latency")
    if wanted("alerts"):
        fields["alerts"] = typed(tuple[Alert, ...], top.get("alerts", []), "alerts")
    if wanted("alert_counts"):
        counts = typed(tuple[tuple[str, str, int], ...], top.get("alert_counts", []), "alert_counts")
        fields["alert_counts"] = {(kind, worker): n for kind, worker, n in counts}
    return fields


def _request(fields: dict, t: float) -> RequestView:
    fields = dict(fields)
    born = typed(float, fields.pop("born"), "born")
    fields["age"] = max(0.0, round(t - born, 2))
    return build(RequestView, fields)


def _worker(fields: dict, t: float) -> WorkerView:
    """A worker's view; its page_states expand to no more pages than its pages_total says."""
    pages = fields.get("pages_total", 0)
    if type(pages) is not int or not 0 <= pages <= MAX_PAGES:
        raise ValueError(f"pages_total must be a whole number of pages up to {MAX_PAGES:,}")
    if "page_states" in fields:
        from_run_lengths(fields["page_states"], limit=pages)
    return build(WorkerView, fields)


def _history(fields: dict, t: float) -> History:
    times = typed(tuple[float, ...], fields["times"], "times")
    series = {name: typed(tuple[float | None, ...], fields.get(name, []), name) for name in SERIES}
    if any(values and len(values) != len(times) for values in series.values()):
        raise ValueError("a history series has not one value per time")
    return History(times, series)


# each collection's item (state[c]["items"][key]) as what the snapshot holds, at frame time t
ITEMS = {"w": _worker, "r": _request, "d": lambda f, t: build(RouteDecision, f),
         "l": lambda f, t: build(LogLine, f), "tl": lambda f, t: build(Timeline, f), "h": _history}


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
            slid = fields[name][k:] + tail
            if len(slid) > MAX_SLID:      # each slide copies the field: a few bytes must not copy megabytes
                raise ValueError(f"{name} slides past {MAX_SLID:,} items")
            fields[name] = slid
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
        added = set(new)
        for k in changes.get("x", ()):
            del items[k]
        for k, fields in changes.get("s", {}).items():
            if k in added:
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
