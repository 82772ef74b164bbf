"""Burst files: JSONL, one request per line, loaded into BurstItems ready for Engine.submit.

A line holds "prompt" (raw text) or "messages" (chat, rendered with the model's template),
an optional "id", and optional sampling fields named as in SamplingParams. Every mistake is
reported with the file and line it is on. The format is documented in sample_prompts/README.md.
"""
from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from engine.config import SamplingParams
from engine.errors import InvalidRequest
from engine.models.catalog import file_kind
from engine.outside import OutsideDataError, load_json

MAX_BURST_FILE_BYTES = 16 * 2**20   # ~16 million characters of prompts: far beyond any burst
MAX_BURST_REQUESTS = 10_000         # requests in one file (--max-burst-requests): each is queued at once

ROLES = ("system", "user", "assistant")

_INTEGER = ((int,), "an integer")
_NUMBER = ((int, float), "a number")
# Sampling fields a line may set: accepted JSON types, and how to name them in an error.
_SAMPLING_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "max_tokens": _INTEGER,
    "temperature": _NUMBER,
    "top_p": _NUMBER,
    "top_k": _INTEGER,
    "min_p": _NUMBER,
    "repetition_penalty": _NUMBER,
    "presence_penalty": _NUMBER,
    "frequency_penalty": _NUMBER,
    "seed": _INTEGER,
    "stop": ((str, list), "a string or a list of strings"),
    "ignore_eos": ((bool,), "true or false"),
}
_KEYS = ("id", "prompt", "messages", *_SAMPLING_FIELDS)


class BurstFileError(InvalidRequest):
    """A burst file could not be read or one of its lines is not a valid request."""


@dataclass(frozen=True)
class BurstItem:
    id: str
    prompt: str | None                 # exactly one of prompt / messages is set
    messages: list[dict] | None
    params: SamplingParams             # validated
    source: str                        # "file.jsonl:LINE", for messages about this item


def load_burst(path: str | Path, max_requests: int = MAX_BURST_REQUESTS) -> list[BurstItem]:
    """The file's requests; a BurstFileError naming the file and line for the first mistake,
    or past `max_requests` requests."""
    path = Path(path)
    try:
        text = read_text_file(path, MAX_BURST_FILE_BYTES)
    except FileNotFoundError:
        raise BurstFileError(f"Burst file not found: {path}") from None
    except (OSError, ValueError) as e:
        raise BurstFileError(f"Cannot read burst file {path}: {e}") from None
    items: list[BurstItem] = []
    seen_ids: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if len(items) == max_requests:
            raise BurstFileError(f"{path}:{number}: more than {max_requests:,} requests in one burst file; "
                                 "split it, or raise the limit with --max-burst-requests")
        item = _parse_line(line, f"{path}:{number}", default_id=f"{path.stem}-{number}")
        if item.id in seen_ids:
            raise BurstFileError(f"{item.source}: id {item.id!r} is already used on {seen_ids[item.id]}; "
                                 "ids must be unique within a file.")
        seen_ids[item.id] = item.source
        items.append(item)
    if not items:
        raise BurstFileError(f"{path} has no requests: write one JSON object per line, "
                             'e.g. {"prompt": "Hello", "max_tokens": 32}.')
    return items


def read_text_file(path: str | Path, limit: int) -> str:
    """The UTF-8 text of a regular file of at most `limit` bytes, for a file named on the
    command line or typed in a dialog. Opened without blocking (a named pipe would wait for
    a writer forever) and read no further than the limit (/dev/zero never ends). Raises
    OSError, or ValueError with a message that completes "cannot read FILE: ..."."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"it is not a regular file (it is {file_kind(mode)})")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"it is larger than {limit / 2**20:g} MiB, the most tokentop reads from such a file")
    return data.decode("utf-8")


def list_burst_files(directory: str | Path) -> list[Path]:
    return sorted(p for p in Path(directory).glob("*.jsonl") if p.is_file())


def default_prompts_dir() -> Path:
    """The sample_prompts/ folder shipped with tokentop.

    Looked up inside the app package first (where an installed wheel carries it, see the
    README there) and then next to the package, where a source checkout has it.
    """
    package_dir = Path(__file__).resolve().parent
    for candidate in (package_dir / "sample_prompts", package_dir.parent / "sample_prompts"):
        if candidate.is_dir():
            return candidate
    raise BurstFileError(f"The sample prompts are missing (looked in {package_dir} and its parent); "
                         "reinstall tokentop or pass a burst file path.")


def _parse_line(line: str, where: str, default_id: str) -> BurstItem:
    def bad(msg: str) -> BurstFileError:
        return BurstFileError(f"{where}: {msg}")

    try:
        obj = load_json(line, source=where)
    except OutsideDataError as e:
        raise BurstFileError(f"{e}.") from None
    if not isinstance(obj, dict):
        raise bad(f"expected a JSON object, got {type(obj).__name__}.")
    unknown = sorted(set(obj) - set(_KEYS))
    if unknown:
        raise bad(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                  f"accepted: {', '.join(_KEYS)}.")

    prompt, messages = obj.get("prompt"), obj.get("messages")
    if (prompt is None) == (messages is None):
        raise bad('needs exactly one of "prompt" (text) or "messages" (chat list), '
                  f"{'found both' if prompt is not None else 'found neither'}.")
    if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
        raise bad('"prompt" must be a non-empty string.')
    if messages is not None:
        _check_messages(messages, bad)

    item_id = obj.get("id", default_id)
    if not isinstance(item_id, str) or not item_id:
        raise bad('"id" must be a non-empty string.')

    sampling = {k: v for k, v in obj.items() if k in _SAMPLING_FIELDS}
    for key, value in sampling.items():
        types, expected = _SAMPLING_FIELDS[key]
        # JSON true/false arrive as bool, which Python counts as an int: only ignore_eos takes one.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise bad(f'"{key}" must be {expected}, got {_shown(value)}.')
    if "stop" in sampling:
        stop = sampling["stop"]
        stop = [stop] if isinstance(stop, str) else stop
        if not all(isinstance(s, str) for s in stop):
            raise bad(f'"stop" must be {_SAMPLING_FIELDS["stop"][1]}.')
        sampling["stop"] = tuple(stop)
    try:
        params = SamplingParams(**sampling).validate()
    except InvalidRequest as e:
        raise bad(str(e)) from None
    return BurstItem(id=item_id, prompt=prompt, messages=messages, params=params, source=where)


def _check_messages(messages: object, bad) -> None:
    if not isinstance(messages, list) or not messages:
        raise bad('"messages" must be a non-empty list of {"role": ..., "content": ...} objects.')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise bad(f'messages[{i}] must be an object with exactly "role" and "content".')
        if m["role"] not in ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {_shown(m['role'])}.")
        if not isinstance(m["content"], str):
            raise bad(f"messages[{i}].content must be a string.")



def _shown(value: object) -> str:
    """A value from the file, short, as it would be written in it."""
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= 60 else text[:57] + "..."
