"""`tokentop watch URL [URL ...]`: the dashboard over servers this process does not own.

One group per server (tokentop serve, vLLM, SGLang, llama.cpp's server, vllm-router): its
state, running / waiting, KV usage, tok/s history, TTFT / ITL percentiles and alerts, from
engine/watch; a tokentop server's workers one line each, and its own percentiles and alerts. `--once` prints one snapshot (text, or `--json`) and exits: 1 when a server is
down, else 0.
"""
from __future__ import annotations

import json
import os
import threading
import time

from rich.text import Text
from textual.app import App, ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Footer, Header, Static

from app.flags import as_flags
from app.widgets.rate_sparkline import spark_bars
from engine.outside import visible
from engine.watch.sources import TIMEOUT
from engine.watch.watcher import ServerStatus, Watcher

SPARK_WIDTH = 40


def _num(v, fmt: str = "{:g}") -> str:
    return "-" if v is None else fmt.format(v)


def _secs(v) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def lines(s: ServerStatus) -> list[tuple[str, str]]:
    """(style, text) lines of one server's group; the same in the dashboard and --once. All a
    server sends is outside text: every line is made visible here, once, for both."""
    return [(style, visible(text)) for style, text in _lines(s)]


def _lines(s: ServerStatus) -> list[tuple[str, str]]:
    head = f"{s.url}  {s.kind}  {s.state}" + (f"  model {s.model}" if s.model else "")
    out = [("bold green" if s.state == "up" and not s.alerts else "bold yellow" if s.state == "up"
            else "bold red", head)]
    if s.state == "up":
        load = f"  running {_num(s.running)}  waiting {_num(s.waiting)}"
        if s.kv_usage is not None:
            load += f"  KV {s.kv_usage * 100:.0f}%"
        if s.slots is not None:
            load += f"  slots busy {s.slots[0]}/{s.slots[1]}"
        if s.running is not None or s.waiting is not None or s.kv_usage is not None or s.slots is not None:
            out.append(("", load))
        if s.requests is not None:
            out.append(("", f"  requests routed {s.requests:g}"))
        if s.tok_s is not None or s.tok_s_history:
            out.append(("", f"  tok/s {_num(s.tok_s, '{:.1f}'):>8}  {spark_bars(tuple(s.tok_s_history), SPARK_WIDTH)}"))
        for key, name, q in (("ttft", "TTFT", s.ttft), ("itl", "ITL", s.itl), ("e2e", "e2e", s.e2e)):
            if any(v is not None for v in q.values()):
                line = f"  {name:<4} " + "  ".join(f"{k} {_secs(v)}" for k, v in q.items())
                if key in s.latency_counts:       # the engine's own records (/snapshot)
                    n, window = s.latency_counts[key]
                    line += f"  ({n} request{'s' if n != 1 else ''}, {_window(window)})"
                out.append(("", line))
        for w in s.engine_workers:
            out.append(("" if w["state"] == "ready" else "yellow", worker_line(w)))
        for w in s.workers:
            health = "healthy" if w["healthy"] else "DOWN"
            out.append(("red" if not w["healthy"] else "", f"  worker {w['url']}  {health}  load {_num(w['load'])}"))
    out += [("bold red" if a.startswith("down") else "bold yellow", f"  ! {a}") for a in s.alerts]
    if s.note:
        out.append(("dim", f"  {as_flags(s.note)}"))
    return out


def _window(name: str) -> str:
    return "the session" if name == "session" else f"last {name}"


def worker_line(w: dict) -> str:
    """One worker of a tokentop server (its /snapshot)."""
    line = f"  {w['name']}  {w['state']}  run {w['running']}/{w['max_active']}  wait {w['waiting']}"
    if w["decode_tps"] is not None:
        line += f"  decode {w['decode_tps']:.1f} tok/s"
    if w["kv"] is not None:
        line += f"  KV {w['kv'] * 100:.0f}%"
    return line + (f"  {w['message']}" if w["message"] else "")


def as_text(statuses: list[ServerStatus]) -> str:
    return "\n\n".join("\n".join(t for _, t in lines(s)) for s in statuses)


def _rich(s: ServerStatus) -> Text:
    text = Text()
    for i, (style, line) in enumerate(lines(s)):
        text.append(("\n" if i else "") + line, style=style or None)
    return text


class WatchApp(App):
    TITLE = "tokentop watch"
    BINDINGS = [("q", "quit", "Quit")]
    CSS = """
    .server { border: round $primary; padding: 0 1; margin: 0 0 1 0; height: auto; }
    """

    def __init__(self, watcher: Watcher, interval: float):
        super().__init__()
        self.watcher, self.interval = watcher, interval
        self.panels: dict[str, Static] = {}
        self._stop = threading.Event()

    def compose(self) -> ComposeResult:
        yield Header()
        with VerticalScroll():
            for url in self.watcher.urls:
                panel = Static(Text(visible(f"{url}  (looking)")), classes="server")
                self.panels[url] = panel
                yield panel
        yield Footer()

    def on_mount(self) -> None:
        threading.Thread(target=self._poll_loop, name="tokentop-watch", daemon=True).start()

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            statuses = self.watcher.poll()
            try:
                self.call_from_thread(self.show, statuses)
            except RuntimeError:       # the app is closing
                return
            self._stop.wait(self.interval)

    def show(self, statuses: list[ServerStatus]) -> None:
        for s in statuses:
            self.panels[s.url].update(_rich(s))

    def on_unmount(self) -> None:
        self._stop.set()


EXIT_WITH_PARENT_ENV = "TOKENTOP_EXIT_WITH_PARENT"   # `tokentop web` sets it to its pid for each tab


def exit_with_parent(parent: int) -> None:
    """Exit once process `parent`, which started this one, is gone. A tab's watch under
    `tokentop web` talks to the page's server over pipes; if that server is killed, the tab must
    not run on with no one to draw for (it would spin at a core's worth of CPU, deaf to SIGTERM)."""
    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch_parent, name="tokentop-parent", daemon=True).start()


def run_watch(urls: list[str], interval: float, once: bool, as_json: bool, api_key: str | None = None,
              timeout: float = TIMEOUT) -> int:
    if os.environ.get(EXIT_WITH_PARENT_ENV, "").isdigit():
        exit_with_parent(int(os.environ[EXIT_WITH_PARENT_ENV]))
    watcher = Watcher(urls, api_key=api_key, timeout=timeout)
    try:
        if once:
            first = watcher.poll()
            time.sleep(interval)               # a second look at those up: rates need two
            statuses = watcher.poll([s.url for s in first if s.state == "up"])
            print(json.dumps([{**s.to_json(), "note": as_flags(s.note)} for s in statuses], indent=2)
                  if as_json else as_text(statuses))
            return 1 if any(s.state == "down" for s in statuses) else 0
        WatchApp(watcher, interval).run()
        return 0
    finally:
        watcher.close()
