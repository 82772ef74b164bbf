"""The lines of a gzip file, one at a time, in bounded memory: a recording comes from outside.

`GzipLines` inflates a bounded piece at a time, so a gzip bomb inflates no further than the
line being read, and refuses a line over the caller's cap. Damage stops the stream at the
damaged byte, not before: everything inflated up to it is still given (a bad CRC trailer
costs no line at all), and `damage` says why it stopped. A `Mark` taken between two lines
lets a reader come back to the next line later without inflating the file from its start
(the inflater's state is copied: its 32 KiB window and little else).
"""
from __future__ import annotations

import os
import zlib
from dataclasses import dataclass

IN_CHUNK = 16 * 1024      # compressed bytes read at a time
OUT_CHUNK = 64 * 1024     # inflated bytes made at a time


class LineTooLong(ValueError):
    """A line longer than the cap the caller gave (its number is `number`)."""

    def __init__(self, number: int, limit: int) -> None:
        super().__init__(f"line {number} is longer than {limit:,} bytes")
        self.number = number


@dataclass(frozen=True)
class Mark:
    """Where the next line starts: enough to read on from there later."""
    offset: int                       # the file position of the next compressed read
    inflater: object | None           # a copy of the inflater's state (None once it ended)
    pending: bytes                    # inflated, not yet given as lines
    number: int                       # lines given before this mark
    ended: bool


class GzipLines:
    """`next_line()` until None; then `damage` (None for a whole stream) and `leftover`
    (bytes after the last newline: a line cut in the middle)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self._file = open(path, "rb")
        self._inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
        self._pending = bytearray()
        self._ended = False
        self.damage: str | None = None
        self.number = 0

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "GzipLines":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def leftover(self) -> bytes:
        return bytes(self._pending)

    def next_line(self, limit: int) -> bytes | None:
        """The next line without its newline, None at the end; LineTooLong past `limit` bytes."""
        searched = 0
        while True:
            at = self._pending.find(b"\n", searched)
            if at != -1:
                line = bytes(self._pending[:at])
                del self._pending[:at + 1]
                self.number += 1
                return line
            if len(self._pending) > limit:
                raise LineTooLong(self.number + 1, limit)
            searched = len(self._pending)
            piece = self._piece()
            if piece is None:
                return None
            self._pending += piece

    def mark(self) -> Mark:
        return Mark(self._file.tell(), None if self._ended else self._inflate.copy(),
                    bytes(self._pending), self.number, self._ended)

    def seek(self, mark: Mark) -> None:
        self._file.seek(mark.offset)
        if mark.inflater is not None:
            self._inflate = mark.inflater.copy()
        self._pending = bytearray(mark.pending)
        self.number = mark.number
        self._ended = mark.ended
        self.damage = None

    def _piece(self) -> bytes | None:
        """The next inflated bytes (at most OUT_CHUNK, unless salvaged), None at the end."""
        while not self._ended:
            data = self._inflate.unconsumed_tail or self._file.read(IN_CHUNK)
            if not data:
                self._ended = True
                if not self._inflate.eof:
                    self.damage = "its compressed stream ends early"
                return None
            before = self._inflate.copy()
            try:
                out = self._inflate.decompress(data, OUT_CHUNK)
            except zlib.error as exc:
                self._ended = True
                self.damage = f"its compressed stream is damaged ({exc})"
                return _salvage(before, data)
            if self._inflate.eof:
                self._ended = True    # what follows the gzip member is not ours to read
            if out:
                return out
        return None


def _salvage(inflate, data: bytes) -> bytes:
    """What `data` inflates to before its first damaged byte (a byte at a time: zlib drops
    a whole call's output when it meets damage). At most IN_CHUNK input bytes."""
    out = bytearray()
    for i in range(len(data)):
        try:
            out += inflate.decompress(data[i:i + 1])
        except zlib.error:
            break
    return bytes(out)
