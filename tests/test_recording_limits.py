"""A recording comes from outside: hostile or damaged files are one-line errors (or play what
precedes the damage), never a traceback, NaN in a trace, or memory that grows with the file.

The probes edit tests/data/replay_burst.rec (written by the project's own recorder from a burst
on two simulated workers); the big ones run in a child with a deadline, their peak RSS measured.
"""
from __future__ import annotations

import gzip
import json
import os
import random
import time
import tracemalloc
import zlib
from pathlib import Path

import pytest

from app.cli import main
from engine.facade import recording_read
from engine.facade.recording_read import read_recording
from engine.facade.snapshot_file import RecordingError
from engine.outside import OutsideDataError, json_depth, load_json
from tests.fixtures.bounded import run_bounded

FIXTURE = Path(__file__).parent / "data" / "replay_burst.rec"
LINES = gzip.decompress(FIXTURE.read_bytes()).decode().split("\n")[:-1]   # header, frames, end
HEADER = json.loads(LINES[0])


def write(path: Path, lines: list[str]) -> Path:
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    return path


def with_frame(index: int, edit) -> list[str]:
    """The fixture's lines with frame line `index` (1 = the first frame) edited as JSON."""
    frame = json.loads(LINES[index])
    edit(frame)
    return LINES[:index] + [json.dumps(frame)] + LINES[index + 1:]


def raw_t(index: int, text: str) -> list[str]:
    """Frame line `index` with its `t` written as `text`, as JSON never would."""
    line = LINES[index]
    start = line.index('"t":') + 4
    end = start + len(str(json.loads(line)["t"]))
    return LINES[:index] + [line[:start] + text + line[end:]] + LINES[index + 1:]


def page_states(value):
    def edit(frame):
        first = frame["w"]["n"][0]
        frame["w"]["s"][first]["page_states"] = value
    return with_frame(1, edit)


def header(**fields) -> list[str]:
    return [json.dumps({**HEADER, **fields})] + LINES[1:]


NESTED = "[" * 100_000 + "]" * 100_000
PROBES = {
    "t 1e400": (raw_t(3, "1e400"), "not finite"),
    "t of 4000 digits": (raw_t(3, "9" * 4000), "is not a number of seconds"),
    "t NaN": (raw_t(3, "NaN"), "not finite"),
    "t -Infinity": (raw_t(3, "-Infinity"), "not finite"),
    "t 1e308": (raw_t(3, "1e308"), "is not a number of seconds"),
    "t going back": (raw_t(3, "0.001"), "goes back"),
    "page_states text": (page_states("abc"), "page_states must be a list"),
    "page_states 2e9": (page_states([0, 2e9]), "page_states must hold integers"),
    "page_states 2 billion": (page_states([0, 2_000_000_000]), "more than the 256 declared"),
    "order names a ghost": (with_frame(5, lambda f: f.update(r={"o": ["ghost"]})), "order does not name"),
    "change to a ghost": (with_frame(5, lambda f: f.update(r={"s": {"ghost": {"worker": 1}}})), "never added"),
    "a request state unknown": (with_frame(5, lambda f: f.update(r={"n": ["q"], "s": {"q": {"id": "q", "state": "zzz",
                                                                                            "born": 1}}})),
                                "'q' is not valid"),
    "started an object": (header(started={}), "'started' is not a time"),
    "workers of ints": (header(workers=[1, 2]), "'workers' are not worker settings"),
    "version 0": (header(version=0), "format version 0 is not one"),
    "version -1": (header(version=-1), "format version -1 is not one"),
    "version true": (header(version=True), "format version true is not one"),
    "a nested header": (['{"format":"tokentop-recording","x":' + NESTED + '}'] + LINES[1:], "nested deeper than 64"),
    "a nested frame": (LINES[:3] + ['{"t":9,"top":' + NESTED + "}"] + LINES[4:], "nested deeper than 64"),
}


@pytest.mark.parametrize("name", PROBES)
def test_each_hostile_recording_is_a_one_line_error(name, tmp_path, capsys):
    lines, words = PROBES[name]
    path = write(tmp_path / "probe.rec", lines)
    code = main(["replay", str(path), "--trace", str(tmp_path / "t.json")])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("tokentop: error: ") and words in err, err
    assert "Traceback" not in err and "Error:" not in err and "TOKENTOP_DEBUG" not in err
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("value", ["NaN", "-Infinity", "1e400"])
def test_a_partial_trace_stops_before_a_non_finite_time_and_holds_no_nan(value, tmp_path, capsys):
    path = write(tmp_path / "nan.rec", raw_t(4, value))
    out = tmp_path / "t.json"
    assert main(["replay", str(path), "--partial", "--trace", str(out)]) == 0
    assert "trace of 3 frames" in capsys.readouterr().err
    def refuse(constant):
        raise AssertionError(f"{constant} in the trace")
    json.loads(out.read_text(), parse_constant=refuse)


def test_a_named_pipe_or_a_folder_is_refused_without_waiting(tmp_path):
    fifo = tmp_path / "pipe.rec"
    os.mkfifo(fifo)
    for path, words in [(fifo, "is not a tokentop recording (it is a named pipe)"), (tmp_path, "Is a directory")]:
        out = run_bounded(f"from engine.facade.recording_read import read_recording\n"
                          f"try:\n    read_recording({str(path)!r})\nexcept Exception as e:\n    print(e)\n",
                          timeout_s=30)
        assert words in out.stdout and out.stdout.count("\n") == 1, out.stdout + out.stderr


def test_a_damaged_crc_trailer_costs_no_frame(tmp_path, capsys):
    data = bytearray(FIXTURE.read_bytes())
    data[-6] ^= 0xFF                                  # the CRC32, before the 4-byte length
    path = tmp_path / "crc.rec"
    path.write_bytes(bytes(data))
    assert main(["replay", str(path), "--trace", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err
    assert "cut short after 35 frames" in err and "damaged" in err and "add --partial" in err
    rec, whole = read_recording(path, partial=True), read_recording(FIXTURE)
    assert len(rec) == len(whole) == 35 and not rec.complete
    assert rec.frame(34) == whole.frame(34)


def test_damage_in_the_middle_costs_only_the_frames_after_it(tmp_path):
    data = bytearray(FIXTURE.read_bytes())
    data[len(data) * 2 // 3] ^= 0x55
    path = tmp_path / "flip.rec"
    path.write_bytes(bytes(data))
    with pytest.raises(RecordingError, match="cut short after"):
        read_recording(path)
    rec, whole = read_recording(path, partial=True), read_recording(FIXTURE)
    assert 10 < len(rec) < len(whole)
    for i in range(len(rec)):
        assert rec.frame(i) == whole.frame(i), i


def test_seeking_anywhere_shows_the_frame_reading_in_order_shows(monkeypatch):
    """Checkpoints every 4 frames: each is a compressed state and a mark of the inflater."""
    in_order = read_recording(FIXTURE)
    expected = [in_order.frame(i) for i in range(len(in_order))]
    monkeypatch.setattr(recording_read, "CHECKPOINT_EVERY", 4)
    rec = read_recording(FIXTURE)
    assert len(rec._checkpoints) == 9
    order = list(range(len(rec)))
    random.Random(7).shuffle(order)
    for i in order + [34, 0, 33, 5, 4, 3, 8, 9]:
        assert rec.frame(i) == expected[i], i


def log_frames(n: int, text=lambda i: "x" * 40_000) -> list[str]:
    """n frame lines, each replacing the one log line with a new one (40 KiB of x by default)."""
    return [json.dumps({"t": i / 5, "l": {"s": {f"k{i}": {"time": i, "level": "info", "text": text(i)}},
                                          "n": [f"k{i}"], **({"x": [f"k{i - 1}"]} if i else {})}})
            for i in range(n)]


def test_a_recording_is_read_a_line_at_a_time(tmp_path):
    """20 MiB of frames, each replacing a 40 KiB log line: the reader never holds them all."""
    path = write(tmp_path / "long.rec", [LINES[0], *log_frames(500), '{"end":500}'])
    tracemalloc.start()
    try:
        rec = read_recording(path)
        snap, _ = rec.frame(250)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(rec) == 500 and rec.complete and snap.log[0].text == "x" * 40_000
    assert peak < 3 << 20, f"{peak:,} bytes at the peak for a 20 MiB recording"


def test_a_frame_of_many_keys_reads_in_linear_time(tmp_path):
    keys = [f"k{i}" for i in range(20_000)]
    many = {"t": 0, "l": {"s": {k: {"time": 1.0, "level": "info", "text": k} for k in keys}, "n": keys}}
    fewer = {"t": 1, "l": {"x": keys[::2]}}
    path = write(tmp_path / "many.rec", [LINES[0], json.dumps(many), json.dumps(fewer), '{"end":2}'])
    start = time.monotonic()
    rec = read_recording(path)
    assert len(rec.frame(0)[0].log) == 20_000 and len(rec.frame(1)[0].log) == 10_000
    assert time.monotonic() - start < 5


def test_a_slide_cannot_copy_a_long_field_every_frame(tmp_path):
    """A 20-byte line that slides a 70,000-character text would copy it whole, every frame."""
    first = {"t": 0, "l": {"s": {"k": {"time": 1.0, "level": "info", "text": "x" * 70_000}}, "n": ["k"]}}
    slides = [json.dumps({"t": i, "l": {"s": {"k": {"~text": [0, "y"]}}}}) for i in range(1, 1000)]
    path = write(tmp_path / "slide.rec", [LINES[0], json.dumps(first), *slides, '{"end":1000}'])
    with pytest.raises(RecordingError, match=r"after 1 frames .*line 3 is not a valid frame: text slides past 65,536"):
        read_recording(path)


def test_frames_that_only_add_stop_at_the_state_cap(tmp_path, monkeypatch):
    """Each line adds a 300 KiB log line and removes none: the state would grow with the file."""
    monkeypatch.setattr(recording_read, "MAX_STATE_BYTES", 4 << 20)
    monkeypatch.setattr(recording_read, "STATE_CHECK_BYTES", 1 << 20)
    adding = [json.dumps({"t": i / 5, "l": {"s": {f"k{i}": {"time": i, "level": "info", "text": "x" * 300_000}},
                                            "n": [f"k{i}"]}}) for i in range(40)]
    path = write(tmp_path / "grow.rec", [LINES[0], *adding, '{"end":40}'])
    with pytest.raises(RecordingError, match=r"cut short after \d+ frames .*: line \d+ makes one frame's state "
                                             r"over 4,194,304 bytes"):
        read_recording(path)
    rec = read_recording(path, partial=True)
    assert 12 <= len(rec) < 20 and len(rec.frame(len(rec) - 1)[0].log) == len(rec)


def gzip_of(head: bytes, filler: bytes, mib: int) -> bytes:
    """`head`, then `mib` MiB of `filler` repeated, as one gzip member; each MiB after the first
    compresses to the same bytes (a full flush resets the window), so 1 GiB is made fast."""
    chunk = filler * ((1 << 20) // len(filler))
    deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    body = deflate.compress(head) + deflate.flush(zlib.Z_FULL_FLUSH)
    body += deflate.compress(chunk) + deflate.flush(zlib.Z_FULL_FLUSH)
    steady = deflate.compress(chunk) + deflate.flush(zlib.Z_FULL_FLUSH)
    crc = zlib.crc32(head)
    for _ in range(mib):
        crc = zlib.crc32(chunk, crc)
    body += steady * (mib - 2) + deflate.compress(chunk) + deflate.flush()
    size = (len(head) + mib * len(chunk)) & 0xFFFFFFFF
    return b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff" + body + crc.to_bytes(4, "little") + size.to_bytes(4, "little")


def test_gzip_of_makes_a_stream_that_inflates_as_it_says():
    data = gzip_of(b"head\n", b"ab", 3)
    assert gzip.decompress(data) == b"head\n" + b"ab" * (3 << 19)


BIG = {
    "a gzip bomb of 1 GiB of zeros": (b"", b"\0", "its first line is over 1,048,576 bytes"),
    "a header, then 1 GiB of zeros": ((LINES[0] + "\n").encode(), b"\0", "line 2 is longer than 16,777,216 bytes"),
    "a header, then 5 MiB of newlines": ((LINES[0] + "\n").encode(), b"\n", "line 2: not valid JSON"),
}


@pytest.mark.parametrize("name", BIG)
def test_huge_inflations_end_fast_in_a_small_memory(name, tmp_path):
    head, filler, words = BIG[name]
    path = tmp_path / "big.rec"
    path.write_bytes(gzip_of(head, filler, 5 if filler == b"\n" else 1024))
    assert path.stat().st_size < 1_200_000
    # VmHWM: this process's own peak since exec (ru_maxrss would count the forked test runner)
    code = ("import sys, time\n"
            "from app.cli import main\n"
            "start = time.monotonic()\n"
            f"code = main(['replay', {str(path)!r}, '--trace', {str(tmp_path / 't.json')!r}])\n"
            "rss = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:')) * 1024\n"
            "print(code, round(time.monotonic() - start, 2), rss)\n")
    out = run_bounded(code, timeout_s=60)
    code, seconds, rss = out.stdout.split()
    assert code == "2" and out.stderr.count("\n") == 1 and words in out.stderr, out.stderr
    assert float(seconds) < 10 and int(rss) < 500 << 20, (seconds, rss)


# --- the JSON loader every reader of outside data uses ------------------------------------------
@pytest.mark.parametrize("text", ['["' + "x" * (4 << 20) + '"]', '["' + "\\n" * (2 << 20) + '"]'],
                         ids=["plain", "escapes"])
def test_counting_depth_skips_a_long_string_in_constant_memory(text):
    tracemalloc.start()
    try:
        assert json_depth(text) == 1
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20, f"{peak:,} bytes to count the depth of {len(text):,} characters"


def test_a_string_that_never_ends_is_refused_in_linear_time():
    start = time.monotonic()
    with pytest.raises(OutsideDataError, match="x.json, line 3: not valid JSON"):
        load_json('"' + '\\"' * 20_000, source="x.json", line=3)
    assert json_depth("[[" + '"' + '\\"' * 20_000 + "[[[") == 2
    assert time.monotonic() - start < 5


async def test_a_recording_changed_under_the_replay_is_a_notice_not_a_crash(tmp_path):
    from app.replay import ReplayApp
    noise = lambda i: random.Random(i).randbytes(2000).hex()   # noqa: E731 - compresses only by half
    path = write(tmp_path / "long.rec", [LINES[0], *log_frames(400, noise), '{"end":400}'])
    rec = read_recording(path)
    path.write_bytes(gzip.compress(b"garbage\n" * 5000))
    with pytest.raises(RecordingError, match=r"changed since it was read: frame 2\d\d no longer reads \("):
        rec.frame(300)
    app = ReplayApp(rec, settings_path=tmp_path / "settings.json", position=rec.times[300], paused=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause(0.2)
        assert app.paused and app.shown_index == -1
        assert any("changed since it was read" in n.message for n in app._notifications)
        await pilot.press("right")
