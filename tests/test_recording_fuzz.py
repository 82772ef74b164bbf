"""Fuzz the recording reader: mutations of a real recording either read back (every frame
builds, the trace holds no NaN) or are one-line RecordingErrors, each within a time and memory cap.

The recording is written by the project's own SnapshotRecorder from six evolving snapshots
(tests/test_replay.py's). Hypothesis drives each mutation through a Random it controls, so a
failing case shrinks: truncation and bit flips of the gzip stream, hostile numbers, nesting,
sizes and types put anywhere in a frame or the header, control characters and bad UTF-8 in the
text, lines dropped, doubled or swapped.
"""
from __future__ import annotations

import gzip
import json
import random
import time
import tracemalloc
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.facade.recording_read import read_recording
from engine.facade.snapshot_file import RecordingError, SnapshotRecorder
from engine.facade.snapshot_trace import recording_events

CASE_SECONDS = 5.0          # per case, on a busy machine; a case takes ~0.1 s
CASE_BYTES = 64 << 20       # peak Python memory per case (tracemalloc)
HOSTILE_NUMBERS = ["1e400", "-1e400", "NaN", "Infinity", "-Infinity", "9" * 400, "-1", "0", "1e308",
                   "2000000000", "-0.0", "4294967297", "0.1", "1" + "0" * 30, "true", "null", '"7"']
OUTCOMES: Counter = Counter()


def base_lines() -> list[str]:
    """The inflated lines of a recording the project's recorder writes."""
    from tests.test_replay import FakeEngine, evolving_snapshots
    return _BASE.setdefault("lines", _record(FakeEngine, evolving_snapshots))


_BASE: dict = {}


def _record(fake_engine, evolving) -> list[str]:
    import tempfile
    snaps = evolving(6)
    path = Path(tempfile.mkdtemp()) / "base.rec"
    recorder = SnapshotRecorder(fake_engine(snaps), path, started=snaps[0].time)
    for _ in range(len(snaps)):
        recorder.record()
    recorder.close()
    return gzip.decompress(path.read_bytes()).decode().split("\n")[:-1]


# --- mutations: each takes the lines and a Random, and gives the file's bytes --------------------
def hostile_value(rnd: random.Random):
    kind = rnd.randrange(9)
    if kind == 0:
        return Nest(rnd.choice([10, 63, 64, 65, 200, 5000]))
    if kind == 1:
        return "x" * rnd.choice([0, 1, 1000, 1 << 20])
    if kind == 2:
        return list(range(rnd.choice([3, 1000, 100_000])))
    if kind == 3:
        return "".join(chr(rnd.choice([0x1B, 0x07, 0x9B, 0x00, 0x7F, 0xD800, 0x41])) for _ in range(rnd.randrange(1, 20)))
    if kind == 4:
        return rnd.choice([{}, [], None, True, "abc", -1, 2 ** 70, 1e308, -1e-300, [0, 2_000_000_000]])
    return Raw(rnd.choice(HOSTILE_NUMBERS))


class Raw(str):
    """Text put in a line as it is (numbers JSON cannot write, deep nesting)."""


def Nest(depth: int) -> Raw:   # noqa: N802 - reads as a value
    return Raw("[" * depth + "]" * depth)


def dumps(value) -> str:
    """JSON of `value`, with Raw pieces put in as they are."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    return json.dumps(value)


def put_anywhere(lines: list[str], rnd: random.Random) -> list[str]:
    """A hostile value at a random place of a random line (header included)."""
    index = rnd.randrange(len(lines))
    doc = json.loads(lines[index])
    node = doc
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            break
        key = rnd.choice(keys)
        child = node[key]
        if isinstance(child, (dict, list)) and child and rnd.random() < 0.7:
            node = child
            continue
        node[key] = hostile_value(rnd)
        break
    return lines[:index] + [dumps(doc)] + lines[index + 1:]


def change_a_number(lines: list[str], rnd: random.Random) -> list[str]:
    import re
    index = rnd.randrange(len(lines))
    numbers = list(re.finditer(r"(?<=[:\[,])-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", lines[index]))
    if not numbers:
        return lines
    m = rnd.choice(numbers)
    line = lines[index][:m.start()] + rnd.choice(HOSTILE_NUMBERS) + lines[index][m.end():]
    return lines[:index] + [line] + lines[index + 1:]


def shuffle_lines(lines: list[str], rnd: random.Random) -> list[str]:
    lines = list(lines)
    i, j = rnd.randrange(len(lines)), rnd.randrange(len(lines))
    action = rnd.randrange(3)
    if action == 0:
        del lines[i]
    elif action == 1:
        lines.insert(i, lines[j])
    else:
        lines[i], lines[j] = lines[j], lines[i]
    return lines


def text_bytes(lines: list[str], rnd: random.Random) -> bytes:
    data = bytearray(("\n".join(lines) + "\n").encode())
    for _ in range(rnd.randrange(1, 4)):
        data[rnd.randrange(len(data)):0] = rnd.choice([b"\x1b[2J", b"\x07", b"\xc2\x9b", b"\xff\xfe", b"\n", b"\x00",
                                                       b"\\", b'"', b"{", b"]"])
    return gzip.compress(bytes(data))


def stream_bytes(lines: list[str], rnd: random.Random) -> bytes:
    data = bytearray(gzip.compress(("\n".join(lines) + "\n").encode()))
    if rnd.random() < 0.5:
        return bytes(data[:rnd.randrange(len(data))])
    for _ in range(rnd.randrange(1, 3)):
        data[rnd.randrange(len(data))] ^= rnd.randrange(1, 256)
    return bytes(data)


LINE_MUTATIONS = [put_anywhere, change_a_number, shuffle_lines]


def mutate(lines: list[str], rnd: random.Random) -> bytes:
    """One to three mutations of the lines, then maybe damage to the text or the stream."""
    for _ in range(rnd.randrange(1, 4)):
        lines = rnd.choice(LINE_MUTATIONS)(lines, rnd)
    last = rnd.randrange(3)
    if last == 1:
        return text_bytes(lines, rnd)
    if last == 2:
        return stream_bytes(lines, rnd)
    return gzip.compress(("\n".join(lines) + "\n").encode())


# --- the check -----------------------------------------------------------------------------------
def read_all(path: Path, partial: bool) -> str:
    """'clean' (every frame builds, its trace is finite JSON) or 'refused' (one-line error)."""
    try:
        rec = read_recording(path, partial=partial)
    except RecordingError as exc:
        assert "\n" not in str(exc) and str(path) in str(exc), str(exc)
        return "refused"
    for i in range(len(rec)):
        rec.frame(i)
    json.dumps(recording_events(rec), allow_nan=False)
    rec.close()
    return "clean"


def bounded_case(path: Path, partial: bool) -> str:
    tracemalloc.start()
    start = time.monotonic()
    try:
        outcome = read_all(path, partial)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    seconds = time.monotonic() - start
    assert seconds < CASE_SECONDS, f"{seconds:.1f} s"
    assert peak < CASE_BYTES, f"{peak:,} bytes"
    return outcome


@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(rnd=st.randoms(use_true_random=False), partial=st.booleans())
def test_a_mutated_recording_reads_back_or_is_a_one_line_error(tmp_path, rnd, partial):
    path = tmp_path / "mutant.rec"
    path.write_bytes(mutate(base_lines(), rnd))
    OUTCOMES[bounded_case(path, partial)] += 1


def test_the_fuzz_ran_both_ways():
    """Runs after the fuzz (file order): both outcomes were reached, so the cases bite."""
    if not OUTCOMES:
        pytest.skip("the fuzz test did not run in this session")
    print(f"recording fuzz: {sum(OUTCOMES.values())} cases, {OUTCOMES['clean']} clean, "
          f"{OUTCOMES['refused']} refused in one line")
    assert OUTCOMES["clean"] >= 5 and OUTCOMES["refused"] >= 30


def test_the_unmutated_recording_reads_clean(tmp_path):
    path = tmp_path / "base.rec"
    path.write_bytes(gzip.compress(("\n".join(base_lines()) + "\n").encode()))
    assert read_all(path, partial=False) == "clean"
    assert len(read_recording(path)) == 6
