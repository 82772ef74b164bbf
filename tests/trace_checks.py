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
