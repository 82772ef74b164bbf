"""Checks on written traces, used by the trace tests (and tools/gpu_check.py)."""
from __future__ import annotations

from typing import Any


def check_nesting(events: list[dict]) -> list[str]:
    """Problems with X spans that partially overlap on a (pid, tid) track; [] when clean."""
    tracks: dict[tuple[Any, Any], list[tuple[int, int, str]]] = {}
    for e in events:
        if e.get("ph") == "X":
            start = round(e["ts"] * 1000)   # back to integer ns: exact comparisons
            tracks.setdefault((e["pid"], e["tid"]), []).append(
                (start, start + round(e["dur"] * 1000), e["name"]))
    problems: list[str] = []
    for track, spans in tracks.items():
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack: list[tuple[int, int, str]] = []
        for start, end, name in spans:
            while stack and stack[-1][1] <= start:
                stack.pop()
            if stack and end > stack[-1][1]:
                parent = stack[-1]
                problems.append(f"track {track}: {name!r} [{start}, {end}] ns overlaps "
                                f"{parent[2]!r} [{parent[0]}, {parent[1]}] ns without nesting")
            stack.append((start, end, name))
    return problems


CHROME_PHASES = {"X", "C", "i", "M"}     # the event types tokentop writes
METADATA_NAMES = {"process_name", "thread_name"}


def check_chrome_trace(document: dict) -> list[str]:
    """Problems with a written trace's shape (Chrome trace event format, JSON object form);
    [] when every event has ph/name/pid/tid (and ts, dur where due) and every track it uses
    is named."""
    problems: list[str] = []
    if not isinstance(document, dict) or not isinstance(document.get("traceEvents"), list):
        return ["not a JSON object with a traceEvents list"]
    if document.get("displayTimeUnit") not in ("ms", "ns") or not isinstance(document.get("metadata"), dict):
        problems.append("displayTimeUnit or metadata missing")
    processes, threads, used = set(), set(), set()
    for i, e in enumerate(document["traceEvents"]):
        where = f"event {i} ({e.get('name')!r})"
        if e.get("ph") not in CHROME_PHASES:
            problems.append(f"{where}: ph {e.get('ph')!r}")
            continue
        if not isinstance(e.get("name"), str) or not isinstance(e.get("pid"), int) or not isinstance(e.get("tid"), int):
            problems.append(f"{where}: name, pid and tid must be a string and two integers")
            continue
        if e["ph"] == "M":
            if e["name"] not in METADATA_NAMES or not isinstance(e.get("args", {}).get("name"), str):
                problems.append(f"{where}: metadata events are process_name / thread_name with args.name")
            (processes if e["name"] == "process_name" else threads).add((e["pid"], e["tid"]))
            continue
        if not isinstance(e.get("ts"), (int, float)):
            problems.append(f"{where}: no ts")
        if e["ph"] == "X" and not (isinstance(e.get("dur"), (int, float)) and e["dur"] >= 0):
            problems.append(f"{where}: an X event needs dur >= 0")
        if e["ph"] == "i" and e.get("s") not in ("t", "p", "g"):
            problems.append(f"{where}: an instant needs a scope s")
        if e["ph"] == "C" and not all(isinstance(v, (int, float)) for v in e.get("args", {}).values()):
            problems.append(f"{where}: counter values must be numbers")
        used.add((e["pid"], e["tid"]))
    named_pids = {pid for pid, _ in processes}
    for pid, tid in sorted(used):
        if pid not in named_pids:
            problems.append(f"process {pid} has no process_name")
        if (pid, tid) not in threads:
            problems.append(f"track ({pid}, {tid}) has no thread_name")
    return problems
