"""Running the HTTP API: headless (`tokentop serve`) or beside the dashboard (`tokentop --serve`).

The listening socket is bound before anything else starts, so a port in use is a one-line
error, not a traceback from a server thread. uvicorn's own log lines go to the engine's event
log (where the dashboard shows them) instead of the terminal; `tokentop serve --access-log`
prints uvicorn's line per request on stderr.
"""
from __future__ import annotations

import copy
import logging
import socket
import threading

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.errors import ConfigError
from engine.serve.app import OpenAIServer, ServeConfig

KEEP_ALIVE_SECONDS = 5         # an idle keep-alive connection is closed after this
MAX_HEAD_BYTES = 16 * 2**10    # request line and headers together
LINGER_SECONDS = 2.0           # a refused body is read and dropped for this long at most,
LINGER_BYTES = 64 * 2**20      # and this many bytes, before its socket closes


def parse_bind(text: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """'8000' or 'HOST:8000' -> (host, port)."""
    host, _, port = text.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        raise ConfigError(f"cannot read {text!r} as [HOST:]PORT: write e.g. 8000 or 0.0.0.0:8000") from None
    if not 0 <= number < 65536:
        raise ConfigError(f"{text!r}: the port must be 0..65535")
    return (host.strip("[]") or default_host), number


def bind(host: str, port: int) -> socket.socket:
    if not host.strip():
        raise ConfigError("the host to listen on is empty (that would be every address); give one, "
                          "e.g. 127.0.0.1, or 0.0.0.0 to listen on all on purpose")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as exc:   # OverflowError: a port outside 0..65535
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {getattr(exc, 'strerror', None) or exc}; "
                          "pick another `port` or stop what uses it") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _EngineLogHandler(logging.Handler):
    def __init__(self, engine):
        super().__init__(logging.WARNING)
        self.engine = engine

    def emit(self, record: logging.LogRecord) -> None:
        level = "error" if record.levelno >= logging.ERROR else "warning"
        self.engine.log(level, f"http: {record.getMessage().splitlines()[0]}")


class _LingeringTransport:
    """The socket transport as uvicorn's protocol and request cycles see it, except close().
    Closing a TCP socket with unread data in it sends a reset, which drops what the response
    has not sent yet and makes the client's send fail: a client still sending a body that the
    server refused (413, 408, 415) would get a broken connection instead of the error. So
    close() asks the protocol, which half-closes and drops the rest of the body first."""

    def __init__(self, transport, protocol: "HeadDeadlineProtocol"):
        self.raw, self._protocol = transport, protocol

    def close(self) -> None:
        self._protocol.close_lingering()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self.raw.is_closing()

    def __getattr__(self, name):
        return getattr(self.raw, name)


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on the client whenever the server waits for it:
    a new connection's (or the next keep-alive request's) line and headers must arrive within
    `head_timeout` seconds, however slowly they trickle in, and so must the rest of a body the
    app left unread. uvicorn itself has no such deadline: a client that connects and sends
    nothing holds its socket, and a connection slot, for ever. (The app reads a body under its
    own deadline, ServeConfig.body_timeout.)"""

    head_timeout = 10.0
    _deadline = None
    _linger = None           # the timer that ends a lingering close
    _linger_left = 0         # bytes it may still drop

    def connection_made(self, transport) -> None:
        super().connection_made(_LingeringTransport(transport, self))
        self._watch()

    @property
    def lingering(self) -> bool:
        return self._linger is not None

    def close_lingering(self) -> None:
        """Close, but where the client is still sending a body, first send what is left of
        the response and an end of stream, then read and drop its body until it ends (or
        LINGER_SECONDS / LINGER_BYTES run out), so that the client reads the response whole."""
        raw = self.transport.raw
        if self.lingering or raw.is_closing():
            return
        if self.conn.their_state is not h11.SEND_BODY or not raw.can_write_eof():
            raw.close()
            return
        self._linger_left = LINGER_BYTES
        self._linger = self.loop.call_later(LINGER_SECONDS, raw.close)
        raw.write_eof()          # after the buffered response
        raw.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            self._linger_left -= len(data)
            if self._linger_left < 0:
                self.transport.raw.close()
            return
        super().data_received(data)
        self._watch()

    def eof_received(self):
        if self.lingering:
            self.transport.raw.close()
        return super().eof_received()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc) -> None:
        self._cancel()
        if self._linger is not None:
            self._linger.cancel()
        super().connection_lost(exc)

    def _watch(self) -> None:
        if self.conn.our_state in (h11.SEND_RESPONSE, h11.SEND_BODY):
            self._cancel()          # a request is being served: the app's deadlines apply
        elif self._deadline is None:
            self._deadline = self.loop.call_later(self.head_timeout, self._expired)

    def _cancel(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.conn.our_state not in (h11.SEND_RESPONSE, h11.SEND_BODY) and not self.transport.is_closing():
            self.transport.close()


class HttpServer:
    """An OpenAIServer on uvicorn, on a socket bound up front."""

    def __init__(self, engine, config: ServeConfig, quiet: bool = False, access_log: bool = False):
        self.api = OpenAIServer(engine, config)
        self.sock = bind(config.host, config.port)
        self.host, self.port = self.sock.getsockname()[:2]
        log_config = None if quiet else copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
        if log_config is not None:     # the access log beside tokentop's own lines, not on stdout
            log_config["handlers"]["access"]["stream"] = "ext://sys.stderr"
        protocol = type("HeadDeadlineProtocol", (HeadDeadlineProtocol,), {"head_timeout": config.header_timeout})
        self.server = uvicorn.Server(uvicorn.Config(
            self.api.app, log_config=log_config, log_level="warning", access_log=access_log,
            timeout_graceful_shutdown=3, lifespan="off", http=protocol,
            timeout_keep_alive=KEEP_ALIVE_SECONDS, h11_max_incomplete_event_size=MAX_HEAD_BYTES))
        if access_log:      # one line per request on stderr, above the warning level of the rest
            logging.getLogger("uvicorn.access").setLevel(logging.INFO)
        warning = config.exposure_warning()
        if warning:
            engine.log("warning", f"http: {warning}")
        if quiet:
            handler = _EngineLogHandler(engine)
            for name in ("uvicorn", "uvicorn.error"):
                logger = logging.getLogger(name)
                logger.handlers[:] = [handler]
                logger.propagate = False
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def run(self) -> None:
        """Serve on this thread until stop() (or Ctrl-C when this is the main thread)."""
        self.server.run(sockets=[self.sock])

    def start(self) -> "HttpServer":
        self._thread = threading.Thread(target=self.run, name="tokentop-http", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.api.close()
