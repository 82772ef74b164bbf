"""What the command line prints, made safe for the terminal it lands on.

Printed text often quotes something from outside: a server's answer, a burst file's ids, a
worker's or a model's name, an error naming a value. `out` and `err` print it with every
control character in caret notation (engine/outside.py), so nothing printed can retitle or
clear the terminal. `json_text` writes a document whose control characters are all escaped:
json.dumps escapes C0 characters, but with ensure_ascii=False it keeps DEL, C1 and lone
surrogates raw.
"""
from __future__ import annotations

import json
import re
import sys

from engine.outside import visible

# DEL, C1 and lone surrogates: in a JSON document they can only be inside strings, where a
# \u escape is the same character
_RAW_IN_JSON = re.compile(r"[\x7f-\x9f\ud800-\udfff]")


def out(text: str) -> None:
    """Text for the user on stdout (a table, a report): its lines kept."""
    print(visible(text, multiline=True), flush=True)


def err(text: str) -> None:
    """One line on stderr (an error, a warning, progress): a newline in it is shown, not taken."""
    print(visible(text), file=sys.stderr, flush=True)


def json_text(value, **kwargs) -> str:
    """json.dumps(value, ensure_ascii=False, ...) with no raw control character left in it."""
    return _RAW_IN_JSON.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(value, ensure_ascii=False, **kwargs))


def stream_text(text: str) -> str:
    """A model's output as `generate` streams it: exact into a pipe or a file, shown on a
    terminal (its lines kept)."""
    return visible(text, multiline=True) if sys.stdout.isatty() else text
