"""`tokentop watch URL [URL ...]`: the dashboard over servers this process does not own.

One group per server (tokentop serve, vLLM, SGLang, llama.cpp's server, vllm-router): its
state, running / waiting, KV usage, tok/s history, TTFT / ITL percentiles and alerts, from
engine/watch. `--once` prints one snapshot (text, or `--json`) and exits: 1 when a server is
down, else 0.
"""
from __future__ import annotations

import json
import threading
import time

from rich.text import Text
from textual.app import App, ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Footer, Header, Static

from app.widgets.rate_sparkline import spark_bars
from engine.watch.watcher import ServerStatus, Watcher

SPARK_WIDTH = 40


def _num(v, fmt: str = "{:g}") -> str:
    return "-" if v is None else fmt.format(v)


def _secs(v) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def lines(s: ServerStatus) -> list[tuple[str, str]]:
    """(style, text) lines of one server's group; the same in the dashboard and --once."""
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
        for name, q in (("TTFT", s.ttft), ("ITL", s.itl)):
            if any(v is not None for v in q.values()):
                out.append(("", f"  {name:<4} " + "  ".join(f"{k} {_secs(v)}" for k, v in q.items())))
        for w in s.workers:
            health = "healthy" if w["healthy"] else "DOWN"
            out.append(("red" if not w["healthy"] else "", f"  worker {w['url']}  {health}  load {_num(w['load'])}"))
    out += [("bold red" if a.startswith("down") else "bold yellow", f"  ! {a}") for a in s.alerts]
    return out


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
                panel = Static(f"{url}  (looking)", classes="server")
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


def run_watch(urls: list[str], interval: float, once: bool, as_json: bool) -> int:
    watcher = Watcher(urls)
    try:
        if once:
            watcher.poll()
            time.sleep(interval)               # a second look: rates need two
            statuses = watcher.poll()
            print(json.dumps([s.to_json() for s in statuses], indent=2) if as_json else as_text(statuses))
            return 1 if any(s.state == "down" for s in statuses) else 0
        WatchApp(watcher, interval).run()
        return 0
    finally:
        watcher.close()
