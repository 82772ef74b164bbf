"""Bounded HTTP reads of servers tokentop does not own (`watch`, `status`).

A GET here has one deadline for the whole exchange: connecting, the headers and every byte of
the body. httpx's timeouts count per operation, so a server that trickles a byte a second
would never time out; a watchdog timer shuts the connection's socket down at the deadline
instead (the socket comes from httpcore's trace of the connect, so every GET opens its own
connection). The body is streamed and refused past its cap, on Content-Length before any of
it is read. A broken rule is a FetchError whose one line names the URL.
"""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import httpx

from engine.outside import OutsideDataError, load_json, visible

MIB = 1 << 20
MAX_BODY = 8 * MIB              # /metrics, /health, /workers, /slots, /v1/models
MAX_SNAPSHOT_BODY = 16 * MIB    # a tokentop /snapshot lists every live request
EXCERPT_CHARS = 200             # of a body quoted in an error message


class FetchError(OutsideDataError):
    """A server could not be reached, did not answer within the deadline, or its answer broke
    a limit (`kind`: unreachable, late, limit); the message names the URL, `reason` is the rest."""

    def __init__(self, url: str, reason: str, kind: str):
        super().__init__(f"{visible(url)}: {reason}")
        self.reason, self.kind = reason, kind


class Deadline:
    """One time limit shared by several requests (a look at a server, a status call)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


@dataclass(frozen=True)
class Reply:
    url: str
    status: int
    body: bytes

    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self):
        """The body as JSON, through the one loader for outside JSON (its depth cap)."""
        return load_json(self.body, source=self.url, max_bytes=max(len(self.body), 1))

    def excerpt(self, limit: int = EXCERPT_CHARS) -> str:
        """The start of the body on one line, safe to print: for an error message."""
        return one_line(self.body[: 4 * limit + 4].decode("utf-8", "replace"), limit)


def one_line(text: str, limit: int = EXCERPT_CHARS) -> str:
    """`text` (outside text, or a message quoting it) on one line of at most `limit`
    characters, control characters made visible."""
    text = " ".join(text[: 4 * limit].split())
    return visible(text[:limit] + "…" if len(text) > limit else text)


class _Watchdog:
    """Shuts the request's socket down when the deadline passes."""

    def __init__(self, seconds: float):
        self.fired = False
        self._socket: socket.socket | None = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(max(seconds, 0.0), self._fire)
        self._timer.daemon = True

    def trace(self, event: str, info: dict) -> None:
        """httpcore's trace hook: keep the connection's socket (the TLS one once wrapped)."""
        if event not in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
            return
        stream = info.get("return_value")
        sock = stream.get_extra_info("socket") if stream is not None else None
        with self._lock:
            self._socket = sock
            fired = self.fired
        if fired:
            self._shut(sock)

    def _fire(self) -> None:
        with self._lock:
            self.fired = True
            sock = self._socket
        self._shut(sock)

    @staticmethod
    def _shut(sock: socket.socket | None) -> None:
        if sock is None:
            return
        try:
            socket.socket.shutdown(sock, socket.SHUT_RDWR)   # wakes a blocked recv in another thread
        except OSError:
            pass                                              # already closed: the GET ended

    def __enter__(self) -> "_Watchdog":
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()


def get(client: httpx.Client, url: str, deadline: Deadline, *, headers: dict | None = None,
        max_bytes: int = MAX_BODY) -> Reply:
    """GET `url`, all of it within `deadline`, the body at most `max_bytes`; else FetchError.
    Any status is a Reply: what a status means is the caller's to say."""
    left = deadline.left()
    if left <= 0:
        raise FetchError(url, _late(deadline), "late")
    headers = {"Connection": "close", "Accept-Encoding": "identity", **(headers or {})}
    watchdog = _Watchdog(left)
    try:
        with watchdog, client.stream("GET", url, headers=headers, timeout=left,
                                     extensions={"trace": watchdog.trace}) as r:
            _check_length(r, url, max_bytes)
            body = _read_capped(r, url, max_bytes)
            return Reply(url, r.status_code, body)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        if watchdog.fired or isinstance(exc, httpx.TimeoutException):
            raise FetchError(url, _late(deadline), "late") from None
        raise FetchError(url, _describe(exc), "unreachable") from None


def _late(deadline: Deadline) -> str:
    return f"no complete answer within {deadline.seconds:g} s"


def _describe(exc: Exception) -> str:
    return one_line(str(exc).strip() or type(exc).__name__)


def _check_length(r: httpx.Response, url: str, max_bytes: int) -> None:
    declared = r.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise FetchError(url, f"the answer is {int(declared):,} bytes, over the {max_bytes:,}-byte limit",
                         "limit")


def _read_capped(r: httpx.Response, url: str, max_bytes: int) -> bytes:
    chunks, size = [], 0
    for chunk in r.iter_bytes():
        size += len(chunk)
        if size > max_bytes:
            raise FetchError(url, f"the answer runs past the {max_bytes:,}-byte limit", "limit")
        chunks.append(chunk)
    return b"".join(chunks)
