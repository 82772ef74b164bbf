"""A recording (engine/facade/snapshot_file.py) read back for `tokentop replay`, as a stream.

The file comes from outside, so it is read a line at a time (engine/facade/gzip_lines.py),
never whole: each line is capped, parsed through engine.outside.load_json and checked
(engine/facade/recording_checks.py) before it is applied. The first pass keeps each frame's
time and, every CHECKPOINT_EVERY frames, a checkpoint: the state then (compressed JSON) and a
mark of the file where the next frame starts. Showing frame i starts from the checkpoint at or
before it, or goes on from the frame shown last, and reads at most CHECKPOINT_EVERY lines.
A bad line ends the recording where it is: the frames before it can still be played.
"""
from __future__ import annotations

import bisect
import json
import os
import stat
import zlib
from dataclasses import dataclass

from engine.facade.gzip_lines import GzipLines, LineTooLong, Mark
from engine.facade.recording_checks import (NotARecording, check_applied, check_changes, check_finite,
                                            check_header, check_time)
from engine.facade.snapshot import EngineSnapshot
from engine.facade.snapshot_file import (CHECKPOINT_EVERY, RecordingError, apply_delta, empty_state,
                                         state_snapshot)
from engine.models.catalog import file_kind
from engine.outside import OutsideDataError, load_json

MAX_HEADER_BYTES = 1 << 20       # the header: worker settings and the command line
MAX_FRAME_BYTES = 16 << 20       # one frame line (the first holds every request's text)
MAX_STATE_BYTES = 64 << 20       # one frame's whole state, as JSON: what the frames add up to
STATE_CHECK_BYTES = 16 << 20     # lines read between two measures of the state
_APPLY_ERRORS = (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError)
_WRITERS = "the dashboard and `tokentop serve` write one when asked to record"


@dataclass(frozen=True)
class Checkpoint:
    state: bytes          # the state after its frame, as zlib-compressed JSON
    mark: Mark            # where the line of the frame after it starts


@dataclass
class Scan:
    """What the first pass over the frames found."""
    times: list[float]
    checkpoints: list[Checkpoint]
    complete: bool = False
    cut: str | None = None    # why the frames end early, if they do


class Recording:
    """A recording read back: `len(rec)` frames at `times`; `frame(i)` is frame i as an
    EngineSnapshot (and the speculation mode of that moment)."""

    def __init__(self, path: str, header: dict, scan: Scan) -> None:
        self.path = path
        self.header = header
        self.started, self.workers = check_header(header)
        self.complete = scan.complete
        self.times = scan.times
        self._checkpoints = scan.checkpoints
        self._lines: GzipLines | None = None
        self._at = -1
        self._state: dict | None = None

    def __len__(self) -> int:
        return len(self.times)

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        if getattr(self, "_lines", None) is not None:
            self._lines.close()
            self._lines = None

    @property
    def duration(self) -> float:
        return self.times[-1] if self.times else 0.0

    def index_at(self, position: float) -> int:
        """The frame shown at `position` seconds: the last one at or before it."""
        return max(0, bisect.bisect_right(self.times, position) - 1)

    def state(self, index: int) -> dict:
        if self._state is None or index < self._at or index - self._at > CHECKPOINT_EVERY:
            base = index // CHECKPOINT_EVERY
            checkpoint = self._checkpoints[base]
            self._state, self._at = json.loads(zlib.decompress(checkpoint.state)), base * CHECKPOINT_EVERY
            self._reader().seek(checkpoint.mark)
        while self._at < index:
            try:
                line = self._reader().next_line(MAX_FRAME_BYTES)
                if line is None:
                    raise ValueError("the file ends before it")
                apply_delta(self._state, load_json(line, source=f"line {self._lines.number}"))
            except (OutsideDataError, *_APPLY_ERRORS) as exc:
                self._state = None     # start again from a checkpoint next time
                raise RecordingError(f"{self.path} changed since it was read: frame {self._at + 2} "
                                     f"no longer reads ({exc})") from None
            self._at += 1
        return self._state

    def _reader(self) -> GzipLines:
        if self._lines is None:
            try:
                self._lines = GzipLines(self.path)
            except OSError as exc:
                raise RecordingError(f"cannot read {self.path} again: {exc.strerror or exc}") from None
        return self._lines

    def frame(self, index: int) -> tuple[EngineSnapshot, str]:
        return state_snapshot(self.state(index), self.started)


def read_recording(path: str | os.PathLike, *, partial: bool = False) -> Recording:
    """Read a recording; a file that is not one, or one cut short or damaged (unless
    `partial`: then the frames before the cut), is a one-line RecordingError."""
    path = os.fspath(path)
    with _open(path) as lines:
        header = _header(lines, path)
        scan = scan_frames(lines, path)
    if not scan.times:
        raise RecordingError(f"{path} holds no frames" + (f": {scan.cut}" if scan.cut else ""))
    if scan.cut is not None and not partial:
        error = RecordingError(f"{path} is cut short after {len(scan.times)} frames ({scan.times[-1]:.1f} s): "
                               f"{scan.cut}; the frames before the cut can be played")
        error.cut_short = True
        raise error
    return Recording(path, header, scan)


def _open(path: str) -> GzipLines:
    try:   # without blocking: a named pipe would wait for a writer forever
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise RecordingError(f"{path} is not a tokentop recording (it is {file_kind(mode)}); {_WRITERS}")
            magic = f.read(2)
        if magic != b"\x1f\x8b":
            raise RecordingError(f"{path} is not a tokentop recording (not a gzip stream); {_WRITERS}")
        return GzipLines(path)
    except FileNotFoundError:
        raise RecordingError(f"{path}: no such file") from None
    except OSError as exc:
        raise RecordingError(f"cannot read {path}: {exc.strerror or exc}") from None


def _header(lines: GzipLines, path: str) -> dict:
    try:
        line = lines.next_line(MAX_HEADER_BYTES)
    except LineTooLong:
        raise RecordingError(f"{path} is not a tokentop recording (its first line is over "
                             f"{MAX_HEADER_BYTES:,} bytes); {_WRITERS}") from None
    if line is None:
        why = lines.damage or ("its first line is cut short" if lines.leftover else "it is empty")
        raise RecordingError(f"{path}: no tokentop-recording header can be read ({why}); {_WRITERS}")
    try:
        header = load_json(line, source="its first line", max_bytes=MAX_HEADER_BYTES)
        check_header(header)
    except (OutsideDataError, NotARecording) as exc:
        raise RecordingError(f"{path} is not a tokentop recording ({exc}); {_WRITERS}") from None
    except ValueError as exc:
        raise RecordingError(f"{path}: {exc}") from None
    return header


def scan_frames(lines: GzipLines, path: str) -> Scan:
    """Every frame line after the header, checked and applied in turn: their times and
    checkpoints, up to the end marker or the first line that is not a valid frame."""
    scan = Scan([], [])
    state = empty_state()
    unmeasured = 0      # bytes of lines applied since the state was last measured
    while True:
        try:
            line = lines.next_line(MAX_FRAME_BYTES)
        except LineTooLong as exc:
            scan.cut = f"line {exc.number} is longer than {MAX_FRAME_BYTES:,} bytes, the most a frame may be"
            return scan
        if line is None:
            break
        try:
            delta = load_json(line, source=f"line {lines.number}")
            if isinstance(delta, dict) and set(delta) == {"end"}:
                scan.cut = _after_end(lines)
                scan.complete = scan.cut is None
                return scan
            apply_frame(state, delta, scan.times[-1] if scan.times else 0.0)
        except OutsideDataError as exc:
            scan.cut = f"{exc}"
            return scan
        except _APPLY_ERRORS as exc:
            scan.cut = f"line {lines.number} is not a valid frame: {exc}"
            return scan
        unmeasured += len(line)
        if unmeasured > STATE_CHECK_BYTES:     # frames that only add (items, slid text) grow it
            unmeasured = 0
            if len(json.dumps(state)) > MAX_STATE_BYTES:
                scan.cut = f"line {lines.number} makes one frame's state over {MAX_STATE_BYTES:,} bytes"
                return scan
        if len(scan.times) % CHECKPOINT_EVERY == 0:
            scan.checkpoints.append(Checkpoint(zlib.compress(json.dumps(state).encode(), 1), lines.mark()))
        scan.times.append(state["t"])
    scan.cut = lines.damage or ("its last line is cut in the middle" if lines.leftover
                                else "the recorder did not finish it")
    return scan


def _after_end(lines: GzipLines) -> str | None:
    """Why the file is damaged after its end marker (a bad CRC, more data), or None."""
    try:
        more = lines.next_line(MAX_FRAME_BYTES)
    except LineTooLong:
        more = b""
    if more is not None or lines.leftover:
        return f"it goes on after its end marker (line {lines.number})"
    return lines.damage


def apply_frame(state: dict, delta, previous: float) -> None:
    """One frame line onto `state`, checked before and after; ValueError or TypeError if it
    is no valid frame (then `state` is no longer usable)."""
    if not isinstance(delta, dict):
        raise ValueError("a frame is an object")
    check_finite(delta)
    check_time(delta, previous)
    check_changes(state, delta)
    apply_delta(state, delta)
    check_applied(state, delta)
