"""`tokentop web [URL ...]`: `tokentop watch` in a browser, served by textual-serve.

textual-serve starts one process per browser tab, running the command it was given. That is
why `web` serves `watch` (a reader of servers' /snapshot and /metrics) and never an engine:
every tab would load its own model. To see a dashboard's engine from a browser, run it with
`tokentop --serve PORT` or `tokentop serve`, and point `web` at that address.

The page is guarded as `serve` guards its API: loopback by default; any other address needs
`--api-key`. The key is given once in the page's address (`/?key=KEY`), answered with an
HttpOnly, SameSite=Strict cookie, and checked on every page and websocket. The websocket also
checks its Origin against the Host (another site's page cannot drive a tab), the Host against
the bound names on loopback (DNS rebinding), and the number of tabs open at once (each is a
process).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import shlex
import sys
from urllib.parse import urlsplit

from app.watch import EXIT_WITH_PARENT_ENV
from engine.errors import ConfigError
from engine.serve.app import host_name, is_loopback

COOKIE = "tokentop_web"
WATCH_KEY_ENV = "TOKENTOP_WATCH_API_KEY"     # the watched servers' key, handed to each tab's watch
MAX_TABS = 8


def watch_command(urls: list[str], interval: float) -> str:
    """The shell command textual-serve runs for one tab (it starts it with a shell): exec, so the
    tab's watch is the server's own child and exits when the server goes (EXIT_WITH_PARENT_ENV)."""
    argv = [sys.executable, "-m", "app.cli", "watch", *urls, "--interval", f"{interval:g}"]
    return f"{EXIT_WITH_PARENT_ENV}={os.getpid()} exec " + " ".join(shlex.quote(a) for a in argv)


def public_url(host: str, port: int) -> str:
    """Where the browser reaches the page: the bound address, or this machine's name when
    bound to every address."""
    if host in ("0.0.0.0", "::", ""):
        import socket
        host = socket.getfqdn()
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def cookie_value(api_key: str) -> str:
    """The cookie proves the key was given without storing the key itself in the browser."""
    return hmac.new(api_key.encode(), b"tokentop web session", hashlib.sha256).hexdigest()


class WebGuard:
    """Who may open the page and its websocket: the key (cookie or ?key=), Origin, Host, tabs."""

    def __init__(self, host: str, api_key: str | None, max_tabs: int = MAX_TABS) -> None:
        self.api_key, self.max_tabs, self.tabs = api_key, max_tabs, 0
        self.hosts = ({"localhost", "127.0.0.1", "::1", host_name(host)} if is_loopback(host) else None)

    def refusal(self, request) -> tuple[int, str] | None:
        """(status, reason) when the request must be refused, else None."""
        if self.hosts is not None and host_name(request.host) not in self.hosts:
            return 403, f"this page does not answer to the host name {host_name(request.host)!r}"
        if request.path == "/ws":
            origin = request.headers.get("Origin")
            if origin and urlsplit(origin).netloc.lower() != request.host.lower():
                return 403, "the websocket is only for this page's own origin"
            if self.tabs >= self.max_tabs:
                return 503, f"{self.max_tabs} tabs are open (each is a process): close one, or raise --max-tabs"
        if self.api_key and not self.has_key(request):
            return 401, "this page needs its key: open it as /?key=KEY (the --api-key tokentop web was started with)"
        return None

    def has_key(self, request) -> bool:
        cookie = request.cookies.get(COOKIE, "")
        given = request.query.get("key", "")
        return (hmac.compare_digest(cookie, cookie_value(self.api_key))
                or (request.path == "/" and hmac.compare_digest(given.encode(), self.api_key.encode())))


def make_server(urls: list[str], host: str, port: int, interval: float, api_key: str | None,
                max_tabs: int = MAX_TABS):
    """A textual-serve Server for `watch URL...`, behind a WebGuard."""
    from aiohttp import web
    from textual_serve.server import Server

    guard = WebGuard(host, api_key, max_tabs)

    @web.middleware
    async def guarded(request, handler):
        refusal = guard.refusal(request)
        if refusal is not None and not request.path.startswith("/static/"):
            raise _refuse(web, *refusal)
        if request.path == "/" and api_key and "key" in request.query:
            found = web.HTTPFound("/")       # the key leaves the address bar and the history
            found.set_cookie(COOKIE, cookie_value(api_key), httponly=True, samesite="Strict")
            raise found
        if request.path != "/ws":
            return await handler(request)
        guard.tabs += 1
        try:
            return await handler(request)
        finally:
            guard.tabs -= 1

    class GuardedServer(Server):
        async def _make_app(self):
            app = await super()._make_app()
            app.middlewares.append(guarded)
            return app

        async def on_startup(self, app) -> None:
            key_hint = "/?key=KEY" if api_key else ""
            print(f"tokentop web: {', '.join(urls)} watched at {self.public_url}{key_hint} "
                  f"(one process per tab, at most {max_tabs}); Ctrl+C stops", flush=True)

    return GuardedServer(watch_command(urls, interval), host=host, port=port, title="tokentop watch",
                         public_url=public_url(host, port))


def _refuse(web, status: int, reason: str):
    return {401: web.HTTPUnauthorized, 403: web.HTTPForbidden,
            503: web.HTTPServiceUnavailable}[status](text=reason + "\n")


def check_web_flags(host: str, port: int, api_key: str | None, max_tabs: int) -> None:
    if api_key is not None and not api_key.strip():
        raise ConfigError("--api-key is empty: give the key the page should ask for, or leave it out on loopback")
    if not host.strip():
        raise ConfigError("--host is empty: give one, e.g. 127.0.0.1, or 0.0.0.0 to listen on every address")
    if not is_loopback(host) and not api_key:
        raise ConfigError(f"--host {host} lets other machines open the page, which reads your servers: "
                          "add --api-key KEY (the browser opens /?key=KEY once), or listen on 127.0.0.1")
    if not 0 < port <= 65535:
        raise ConfigError(f"--port {port}: give a port in 1..65535, e.g. --port 8080")
    if max_tabs < 1:
        raise ConfigError("--max-tabs must be at least 1")


def run_web(urls: list[str], host: str, port: int, interval: float, api_key: str | None,
            server_api_key: str | None, max_tabs: int = MAX_TABS) -> int:
    check_web_flags(host, port, api_key, max_tabs)
    try:
        import textual_serve  # noqa: F401
    except ImportError:
        raise ConfigError("tokentop web needs textual-serve: pip install textual-serve") from None
    if server_api_key:
        os.environ[WATCH_KEY_ENV] = server_api_key       # each tab's watch reads it; not on its command line
    make_server(urls, host, port, interval, api_key, max_tabs).serve()
    return 0
