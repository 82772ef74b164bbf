"""The one boundary for data that came from outside tokentop.

Text that a client, a file or a server gave us is shown or printed only through `visible`,
which turns every control character (C0, DEL, C1) and every lone UTF-16 surrogate into
printable caret notation: ESC is `^[`, BEL `^G`, the C1 CSI byte `<9b>`. Nothing from outside
can then move the cursor, retitle the terminal or clear the screen. Tab and newline are kept
only where the caller asks for multi-line text.

JSON from outside is parsed only through `load_json`, which refuses a body over its byte cap
or nested deeper than its depth cap before json.loads sees it (json.loads would recurse, and
a RecursionError is no message for a user), and names the source and the line.
"""
from __future__ import annotations

import json
import re

from engine.errors import TokentopError

MAX_JSON_DEPTH = 64                   # a snapshot nests 6 deep, a recording frame 7
MAX_JSON_BYTES = 16 * 1024 * 1024     # one document: a /snapshot, a frame, a burst line

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_CONTROL_MULTILINE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
# A JSON string (escapes included), one bracket, or a quote that opens a string never closed:
# enough to count nesting without parsing. Possessive, with no group repeated per character,
# so the regex engine keeps no state per character: a 16 MiB string costs no memory to skip.
_JSON_TOKEN = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+"|[\[\]{}]|"', re.DOTALL)


class OutsideDataError(TokentopError):
    """Data from outside (a file, a server, a client) broke a rule; the message names where."""


def _caret(match: re.Match) -> str:
    code = ord(match.group())
    if code < 0x20:
        return "^" + chr(code + 0x40)
    if code == 0x7F:
        return "^?"
    return f"<{code:x}>"


def visible(text: object, *, multiline: bool = False) -> str:
    """`text` as a string that is safe to draw or print: control characters and lone
    surrogates in caret notation. With multiline, newlines and tabs are kept as they are."""
    text = text if isinstance(text, str) else str(text)
    pattern = _CONTROL_MULTILINE if multiline else _CONTROL
    return pattern.sub(_caret, text)


def json_depth(text: str) -> int:
    """The deepest nesting of brackets in a JSON text, strings skipped, in linear time."""
    depth = deepest = 0
    for token in _JSON_TOKEN.finditer(text):
        if token.end() - token.start() > 1:
            continue  # a whole string, not copied out
        char = text[token.start()]
        if char == '"':
            break     # a string that never ends: what follows is in it (and json.loads refuses it)
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def load_json(data: str | bytes, *, source: str, line: int | None = None,
              max_depth: int = MAX_JSON_DEPTH, max_bytes: int = MAX_JSON_BYTES):
    """Parse one JSON document from outside, or raise OutsideDataError naming `source` (a file
    or URL) and `line`. The caps are checked before parsing."""
    where = visible(source) + (f", line {line}" if line is not None else "")
    if len(data) > max_bytes:
        raise OutsideDataError(f"{where}: {len(data):,} bytes is over the {max_bytes:,}-byte "
                               "limit for one JSON document")
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise OutsideDataError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if json_depth(data) > max_depth:
        raise OutsideDataError(f"{where}: JSON nested deeper than {max_depth} levels")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise OutsideDataError(f"{where}: not valid JSON ({visible(exc)})") from None
