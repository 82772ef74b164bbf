"""What a recording's lines must be before a replay trusts them: a recording comes from outside.

Checked as the file is read, so a damaged or hostile line stops the reading where it is (the
frames before it can still be played) instead of reaching the dashboard or a trace:
- every number finite (1e400, NaN are refused), and of a sane size where it is built,
- the header: a known format version, `started` a time, `workers` a list of worker settings,
- a frame's `t`: seconds since the start, never going back,
- each collection's changes: keys that exist, an order that names every item once,
- each item a frame touches builds as what the snapshot holds (types checked), and a
  worker's page_states expands to no more pages than its `pages_total` declares.
Each check raises ValueError (or TypeError) with what is wrong; the reader adds where.
"""
from __future__ import annotations

import json
from typing import Any

from engine.config import WorkerConfig
from engine.errors import TokentopError
from engine.facade.snapshot_file import COLLECTIONS, FORMAT, ITEMS, MAX_NUMBER, VERSION, build, top_fields

MAX_SECONDS = 10 * 365 * 86400.0   # a frame's `t`: ten years of recording
MAX_WORKERS = 1024
# what building an item from a file's values may raise: each names the value that is wrong
BUILD_ERRORS = (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, TokentopError)


class NotARecording(ValueError):
    """The first line is no tokentop recording header."""


def check_finite(value: Any) -> None:
    """No NaN or infinity anywhere in a parsed JSON value (json.loads reads 1e400 as inf);
    the magnitude of each number a snapshot holds is checked where it is built."""
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        raise ValueError("it holds a number that is not finite (NaN, Infinity or one like 1e400)") from None


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 24 else text[:20] + "…"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_header(header: Any) -> tuple[float, tuple[WorkerConfig, ...]]:
    """The header's start time and worker settings; NotARecording or ValueError otherwise."""
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise NotARecording("no tokentop-recording header")
    version = header.get("version")
    if type(version) is int and version > VERSION:
        raise ValueError(f"it is a recording of format {version}; this tokentop reads format {VERSION} "
                         "and older: replay it with a newer tokentop")
    if type(version) is not int or version < 1:
        raise ValueError(f"its format version {_short(version)} is not one tokentop writes "
                         f"(this tokentop reads format {VERSION} and older)")
    try:
        check_finite(header)
    except ValueError as exc:
        raise ValueError(f"its header: {exc}") from None
    started = header.get("started", 0.0)
    if not _number(started) or not 0 <= started <= MAX_NUMBER:
        raise ValueError("its header's 'started' is not a time (seconds since 1970)")
    interval = header.get("interval_s", 0.2)
    if not _number(interval) or not 0 < interval <= MAX_SECONDS:
        raise ValueError("its header's 'interval_s' is not a positive number of seconds")
    workers = header.get("workers", [])
    if not isinstance(workers, list) or len(workers) > MAX_WORKERS:
        raise ValueError(f"its header's 'workers' is not a list of up to {MAX_WORKERS} worker settings")
    try:
        configs = tuple(build(WorkerConfig, w) for w in workers)
    except BUILD_ERRORS as exc:
        raise ValueError(f"its header's 'workers' are not worker settings ({exc})") from None
    return float(started), configs


def check_time(delta: dict, previous: float) -> float:
    """A frame line's 't': seconds since the start, not before the frame before it."""
    t = delta.get("t")
    if not _number(t) or not 0 <= t <= MAX_SECONDS:
        raise ValueError(f"its time 't' {_short(t)} is not a number of seconds from 0 to {MAX_SECONDS:g}")
    if t < previous:
        raise ValueError(f"its time 't' {t} goes back (the frame before it is at {previous})")
    return t


def check_changes(state: dict, delta: dict) -> None:
    """A frame line's shape, before it is applied to 'state'."""
    if not isinstance(delta.get("top", {}), dict):
        raise ValueError("its 'top' is not an object")
    for c in COLLECTIONS:
        changes = delta.get(c)
        if changes is None:
            continue
        if not isinstance(changes, dict):
            raise ValueError(f"its '{c}' is not an object")
        items = state[c]["items"]
        changed, new, gone = changes.get("s", {}), changes.get("n", []), changes.get("x", [])
        if not isinstance(changed, dict) or not all(isinstance(v, dict) for v in changed.values()):
            raise ValueError(f"its '{c}.s' is not an object of objects")
        for name, keys in (("n", new), ("x", gone), ("o", changes.get("o", []))):
            if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                raise ValueError(f"its '{c}.{name}' is not a list of keys")
        new_set, gone_set = set(new), set(gone)      # sets: a line may name 10^5 keys
        if any(k not in items for k in gone) or len(gone_set) != len(gone):
            raise ValueError(f"its '{c}.x' removes a key that is not there")
        if any(k not in changed or (k in items and k not in gone_set) for k in new) or len(new_set) != len(new):
            raise ValueError(f"its '{c}.n' adds a key without its fields, or one already there")
        if any(k not in items and k not in new_set for k in changed):
            raise ValueError(f"its '{c}.s' changes a key that was never added")


def check_applied(state: dict, delta: dict) -> None:
    """After a frame line is applied: every order names each item once, and every item the
    line touched (and the top, if it changed) builds as the snapshot would build it."""
    if "top" in delta:
        top_fields(state["top"], delta["top"])
    for c in COLLECTIONS:
        changes = delta.get(c)
        if not changes:
            continue
        keys, items = state[c]["keys"], state[c]["items"]
        if len(keys) != len(items) or set(keys) != set(items):
            raise ValueError(f"its '{c}' order does not name every item exactly once")
        for key in changes.get("s", {}):
            try:
                ITEMS[c](items[key], state["t"])
            except BUILD_ERRORS as exc:
                raise ValueError(f"its '{c}' item {key!r} is not valid ({exc})") from None
        if c == "h" and not all(k.isascii() and k.isdigit() and len(k) < 7 for k in keys):
            raise ValueError("its 'h' keys are not worker numbers")
