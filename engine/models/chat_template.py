"""Chat templates, rendered in a helper process under a time and a memory budget.

A chat template is code from the model file. Jinja's sandbox keeps it away from Python's
internals, but not from looping for hours or doubling a string until memory runs out, and
no check inside the interpreter can stop a single C call that builds a 2 GB string. So every
render runs in one long-lived helper process: an address-space limit (setrlimit) turns a
memory bomb into a MemoryError there, and a render that runs past its time budget is killed
with its process; the next render starts a fresh one. A template over budget fails the
request that rendered it, with a message that says which budget.

The helper runs this file as a script in isolated mode (`python -I`): it imports only the
standard library and jinja2, never the engine. Requests and replies are JSON frames, each
after an 8-byte length, on the helper's stdin and stdout.
"""
from __future__ import annotations

import json
import operator
import os
import select
import struct
import subprocess
import sys
import threading
import time
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_SECONDS = 2.0            # a real template renders in about a millisecond
RENDER_MEMORY = 512 * 2**20     # the helper's address space, interpreter included
MAX_OUTPUT_CHARS = 16 * 2**20   # longest rendered chat: far past any context window
MAX_TEMPLATE_REPEAT = 1_000_000  # longest string or list a template may build with *
_HEADER = struct.Struct(">Q")


class TemplateFailed(Exception):
    """The template raised an error, or broke a rule of the sandbox, for these messages."""


class TemplateOverBudget(Exception):
    """The template ran past its time or memory budget (the helper was stopped)."""


# --- the caller's side -----------------------------------------------------------------------

class TemplateRenderer:
    """One helper process, started on first use, serving one render at a time."""

    def __init__(self, seconds: float = RENDER_SECONDS, memory: int = RENDER_MEMORY) -> None:
        self.seconds, self.memory = seconds, memory
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def render(self, template: str, variables: dict[str, Any]) -> str:
        frame = json.dumps({"template": template, "variables": variables}, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass")
        with self._lock:
            proc = self._proc if self._proc is not None and self._proc.poll() is None else self._start()
            deadline = time.monotonic() + self.seconds
            try:
                _write_frame(proc.stdin, frame)
                reply = json.loads(_read_frame_by(proc.stdout.fileno(), deadline,
                                                  4 * MAX_OUTPUT_CHARS + 4096).decode("utf-8", "surrogatepass"))
            except TimeoutError:
                self._stop()
                raise TemplateOverBudget(f"it ran for more than {self.seconds:g} s") from None
            except (OSError, EOFError, ValueError):
                # the helper died: past its address-space limit where Python could not say so
                self._stop()
                raise TemplateOverBudget(f"its helper process stopped (more than {self.memory // 2**20} MiB "
                                         "needed, or it was killed)") from None
        if "error" in reply:
            cls = TemplateOverBudget if reply.get("over_budget") else TemplateFailed
            raise cls(reply["error"])
        return reply["text"]

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _start(self) -> subprocess.Popen:
        self._proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), str(self.memory)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, close_fds=True)
        return self._proc

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                pipe.close()
            self._proc = None


_RENDERER = TemplateRenderer()


def render_chat_template(template: str, variables: dict[str, Any]) -> str:
    """`template` rendered with `variables` (JSON values) in the shared helper process.
    Raises TemplateFailed or TemplateOverBudget."""
    return _RENDERER.render(template, variables)


def _write_frame(pipe, data: bytes) -> None:
    pipe.write(_HEADER.pack(len(data)) + data)
    pipe.flush()


def _read_frame_by(fd: int, deadline: float, limit: int) -> bytes:
    """One frame from fd, or TimeoutError at the deadline; EOFError if the writer is gone."""
    def read_exactly(n: int) -> bytes:
        chunks, got = [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, min(n - got, 2**20))
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    (size,) = _HEADER.unpack(read_exactly(_HEADER.size))
    if size > limit:
        raise EOFError
    return read_exactly(size)


# --- the helper's side -----------------------------------------------------------------------

class TemplateSandbox(ImmutableSandboxedEnvironment):
    """Jinja2 as Hugging Face renders chat templates (trim_blocks, lstrip_blocks, loop controls,
    raise_exception / strftime_now / tojson), but an unsafe attribute access fails loudly instead of
    rendering as an empty string, and `*` / `**` cannot build huge values."""

    intercepted_binops = frozenset({"*", "**"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        self.filters["tojson"] = _tojson
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        if op == "**":
            if isinstance(right, (int, float)) and abs(right) > 100:
                raise SecurityError(f"exponent {right} is too large for a chat template")
            return operator.pow(left, right)
        for seq, count in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
                if len(seq) * count > MAX_TEMPLATE_REPEAT:
                    raise SecurityError(f"a chat template may not build a sequence longer than {MAX_TEMPLATE_REPEAT:,}")
        return operator.mul(left, right)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which changes the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _render(env: TemplateSandbox, compiled: dict, template: str, variables: dict) -> str:
    if template not in compiled:
        compiled.clear()            # one model's template at a time, in practice
        compiled[template] = env.from_string(template)
    parts, size = [], 0
    for piece in compiled[template].generate(**variables):
        size += len(piece)
        if size > MAX_OUTPUT_CHARS:
            raise TemplateOverBudget(f"its output passed {MAX_OUTPUT_CHARS:,} characters")
        parts.append(piece)
    return "".join(parts)


def _serve(memory: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    env, compiled = TemplateSandbox(), {}
    while True:
        header = stdin.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return                  # the caller is gone
        request = json.loads(stdin.read(_HEADER.unpack(header)[0]).decode("utf-8", "surrogatepass"))
        try:
            reply = {"text": _render(env, compiled, request["template"], request["variables"])}
        except MemoryError:
            reply = {"error": f"it needed more than {memory // 2**20} MiB", "over_budget": True}
        except TemplateOverBudget as exc:
            reply = {"error": str(exc), "over_budget": True}
        except Exception as exc:    # the template's own error, or the sandbox's
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        _write_frame(stdout, json.dumps(reply, ensure_ascii=False).encode("utf-8", "surrogatepass"))


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
