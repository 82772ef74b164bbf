"""`watch` and `status` against a hostile server (engine/watch/fetch.py, engine/watch/sources.py,
app/status.py): huge, nested, trickling, escape-laden, 500, many-series and wrong-content answers.

The server is stdlib http.server on 127.0.0.1 in a thread. Each case must end within its
`--timeout` plus a second (plus the one `--interval` pause a watch --once takes), as one clear
line (status) or as that server down with the reason (watch), with no escape byte in any
output. The huge answers are read by `status` in a subprocess whose peak RSS is checked.
"""
from __future__ import annotations

import contextlib
import gzip
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import app.watch  # noqa: F401  (the dashboard's imports, once, outside every timed case)
from app.cli import main

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 2.0                      # the --timeout every case runs with
INTERVAL = 0.1                     # watch --once's pause between its two looks
ESC = "\x1b]0;pwned\x07\x1b[2J\x9b2J"
HUGE = 500 * 2**20                 # what a huge answer claims, or streams until the reader stops
RSS_LIMIT = 500 * 2**20

TOKENTOP_METRICS = ('# TYPE tokentop:worker_info gauge\n'
                    'tokentop:worker_info{worker="0",name="sim:gpu0"} 1\n'
                    '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{worker="0"} 0\n')
WORKER = {"index": 0, "name": "sim:gpu0", "state": "ready", "message": "", "running": 0, "waiting": 0,
          "max_active": 8, "prefill_tps": 0.0, "decode_tps": 0.0, "kv": {"usage": 0.1}, "cpu_percent": None,
          "rss_bytes": None}
SNAPSHOT = {"version": 1, "uptime": 5.0, "router_policy": "cost", "requests": [], "workers": [WORKER],
            "latency": {w: {"seconds": 60.0, "overall": {}} for w in ("60s", "session")}, "alerts": []}


# --- what a page can do -----------------------------------------------------------------------
def answer(body: bytes | str | dict, status: int = 200, ctype: str = "application/json", length: bool = True,
           headers: dict | None = None):
    data = body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body)).encode()

    def page(h: BaseHTTPRequestHandler) -> None:
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        if length:
            h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
    return page


def huge(declared: bool, fill: bytes = b'{"a": "' + b"x" * 65536):
    """HUGE bytes of JSON-looking text, streamed until the reader hangs up."""
    def page(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        if declared:
            h.send_header("Content-Length", str(HUGE))
        h.end_headers()
        for _ in range(HUGE // len(fill)):
            h.wfile.write(fill)
    return page


def trickle(headers_too: bool):
    """One byte every 1.5 s: of the body, or already of the status line and headers."""
    def page(h: BaseHTTPRequestHandler) -> None:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
        if not headers_too:
            h.wfile.write(head)
            head = b""
        for byte in head + b"{" * 1000:
            if h.server.closing.wait(1.5):
                return
            h.wfile.write(bytes([byte]))
            h.wfile.flush()
    return page


def slow_but_whole(body: dict):
    """A legitimate slow server: the whole answer in 0.6 s, in pieces, within the deadline."""
    data = json.dumps(body).encode()

    def page(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        step = max(1, len(data) // 6)
        for i in range(0, len(data), step):
            time.sleep(0.1)
            h.wfile.write(data[i:i + step])
            h.wfile.flush()
    return page


GZIP_BOMB = gzip.compress(b"\0" * (32 * 2**20), compresslevel=9)     # 32 KiB that inflate to 32 MiB


@contextlib.contextmanager
def hostile_server(pages: dict):
    """127.0.0.1 server: GET path -> pages[path](handler); 404 for the rest."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            page = pages.get(self.path, answer("Not Found", 404, "text/plain"))
            try:
                page(self)
            except OSError:               # the reader hung up: it was told to
                pass

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    srv.closing = threading.Event()
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.closing.set()
        srv.shutdown()
        srv.server_close()


GOOD_SNAPSHOT = answer(SNAPSHOT)


def tokentop_pages(**overrides) -> dict:
    """A tokentop server's pages (/metrics, /health, /snapshot), some replaced."""
    pages = {"/metrics": answer(TOKENTOP_METRICS, ctype="text/plain"), "/health": answer({"status": "ok"}),
             "/snapshot": GOOD_SNAPSHOT}
    return {**pages, **{"/" + k.strip("/"): v for k, v in overrides.items()}}


# --- the cases --------------------------------------------------------------------------------
# name, the pages, what watch says of the server (state, text in its error or note), what status
# says (None: it reads fine; else a text of its one-line error)
CASES = [
    ("nested snapshot", tokentop_pages(snapshot=answer("[" * 100_000 + "]" * 100_000)),
     ("down", "nested deeper than"), "nested deeper than"),
    ("huge snapshot, declared", tokentop_pages(snapshot=huge(declared=True)),
     ("down", "over the 16,777,216-byte limit"), "over the 16,777,216-byte limit"),
    ("huge snapshot, undeclared", tokentop_pages(snapshot=huge(declared=False)),
     ("down", "past the 16,777,216-byte limit"), "past the 16,777,216-byte limit"),
    ("gzip bomb snapshot", tokentop_pages(snapshot=answer(GZIP_BOMB, headers={"Content-Encoding": "gzip"})),
     ("down", "past the 16,777,216-byte limit"), "past the 16,777,216-byte limit"),
    ("trickled body", tokentop_pages(snapshot=trickle(headers_too=False)),
     ("down", f"no complete answer within {TIMEOUT:g} s"), f"no complete answer within {TIMEOUT:g} s"),
    ("trickled headers", tokentop_pages(snapshot=trickle(headers_too=True)),
     ("down", f"no complete answer within {TIMEOUT:g} s"), f"no complete answer within {TIMEOUT:g} s"),
    ("escape-laden 500", tokentop_pages(snapshot=answer(ESC * 50_000, 500, "text/plain")),
     ("up", "/snapshot answers 500"), "answered 500: ^[]0;pwned^G^[[2J<9b>2J"),
    ("escape-laden fields", tokentop_pages(snapshot=answer({**SNAPSHOT, "router_policy": ESC, "workers": [
        {**WORKER, "name": ESC, "message": ESC}], "alerts": [{"kind": ESC, "message": ESC}]})),
     ("up", ""), None),
    ("escape-laden version", tokentop_pages(snapshot=answer({**SNAPSHOT, "version": ESC * 1000})),
     ("up", "/snapshot not read"), "this tokentop reads version 1"),
    ("html snapshot", tokentop_pages(snapshot=answer("<html><body>hello</body></html>", ctype="text/html")),
     ("down", "not valid JSON"), "not valid JSON"),
    ("binary snapshot", tokentop_pages(snapshot=answer(bytes(range(256)) * 64, ctype="application/octet-stream")),
     ("down", "not UTF-8"), "not UTF-8"),
    ("many series", tokentop_pages(metrics=answer(TOKENTOP_METRICS + "".join(
        f'vllm:num_requests_running{{worker="{i}"}} 1\n' for i in range(30_000)), ctype="text/plain")),
     ("down", "more than 20,000 series"), None),
    ("huge metrics, undeclared", tokentop_pages(metrics=huge(declared=False, fill=b"a 1\n" * 16384)),
     ("down", "past the 8,388,608-byte limit"), None),
    ("escape-laden metrics", tokentop_pages(metrics=answer(ESC + " 1\n" + ESC * 10_000, ctype="text/plain")),
     ("down", "^["), None),
    ("deep workers", tokentop_pages(workers=answer('{"workers": ' + "[" * 10_000 + "]" * 10_000 + "}")),
     ("down", "nested deeper than"), None),
    ("thousands of workers", tokentop_pages(snapshot=answer({**SNAPSHOT, "workers": [WORKER] * 5000})),
     ("up", "more than 1024 workers or alerts"), None),
    ("thousands of router workers", tokentop_pages(workers=answer({"workers": [{"url": "x"}] * 5000})),
     ("down", "lists more than 1024 workers"), None),
    ("slow but whole", tokentop_pages(snapshot=slow_but_whole(SNAPSHOT)), ("up", ""), None),
]


def _no_escape(text: str) -> bool:
    return not any(c in text for c in "\x1b\x07\x9b")


def _watch(url: str, capsys) -> tuple[dict, float]:
    start = time.monotonic()
    main(["watch", url, "--once", "--json", "--interval", str(INTERVAL), "--timeout", str(TIMEOUT)])
    took = time.monotonic() - start
    out, err = capsys.readouterr()
    assert _no_escape(out) and _no_escape(err) and "Traceback" not in err
    (server,) = json.loads(out)
    return server, took


# a trickling server's watch: in test_one_hostile_server_leaves_the_others_updating
WATCH_CASES = [c for c in CASES if not c[0].startswith("trickled")]


@pytest.mark.parametrize("name,pages,watch_says,status_says", WATCH_CASES, ids=[c[0] for c in WATCH_CASES])
def test_watch_marks_a_hostile_server_down_with_the_reason_in_time(name, pages, watch_says, status_says, capsys):
    with hostile_server(pages) as url:
        server, took = _watch(url, capsys)
    assert took < (TIMEOUT if watch_says[0] == "down" else 2 * TIMEOUT) + INTERVAL + 1, took   # one look when down
    state, reason = watch_says
    assert server["state"] == state, server
    said = server["error"] if state == "down" else server["note"]
    assert reason in said and len(said) < 400 and _no_escape(said), said
    if state == "up" and not reason:
        assert server["source"] == "snapshot" and server["engine_workers"][0]["state"] == "ready"


STATUS_CASES = [(c[0], c[1], c[3]) for c in CASES if c[1]["/snapshot"] is not GOOD_SNAPSHOT]


@pytest.mark.parametrize("name,pages,status_says", STATUS_CASES, ids=[c[0] for c in STATUS_CASES])
def test_status_of_a_hostile_server_is_one_line_in_time(name, pages, status_says, capsys):
    with hostile_server(pages) as url:
        start = time.monotonic()
        rc = main(["status", url, "--json", "--timeout", str(TIMEOUT)])
        took = time.monotonic() - start
    out, err = capsys.readouterr()
    assert took < TIMEOUT + 1, took
    assert _no_escape(out) and _no_escape(err) and "Traceback" not in err
    if status_says is None:
        assert rc == 0 and json.loads(out)["version"] == 1
    else:
        assert rc == 2 and out == "" and err.count("\n") == 1 and len(err) < 500, err
        assert status_says in err, err


def test_one_hostile_server_leaves_the_others_updating(capsys):
    good = {"/metrics": answer(TOKENTOP_METRICS.replace("tokentop:worker_info", "vllm:x"), ctype="text/plain"),
            "/health": answer({})}
    with hostile_server(good) as fine, \
            hostile_server(tokentop_pages(snapshot=answer("[" * 100_000))) as nested, \
            hostile_server(tokentop_pages(metrics=trickle(headers_too=False))) as slow, \
            hostile_server(tokentop_pages(workers=trickle(headers_too=True))) as slower:
        start = time.monotonic()
        main(["watch", nested, slow, slower, fine, "--once", "--json", "--interval", str(INTERVAL),
              "--timeout", str(TIMEOUT)])
        took = time.monotonic() - start
    servers = {s["url"]: s for s in json.loads(capsys.readouterr().out)}
    assert took < TIMEOUT + INTERVAL + 1, took             # side by side, and no second look at one down
    assert servers[fine]["state"] == "up" and servers[fine]["kind"] == "vllm"
    assert servers[nested]["state"] == servers[slow]["state"] == servers[slower]["state"] == "down"
    assert "nested deeper than" in servers[nested]["error"]
    assert servers[slow]["error"] == f"{slow}/metrics: no complete answer within {TIMEOUT:g} s"
    assert servers[slower]["error"] == f"{slower}/workers: no complete answer within {TIMEOUT:g} s"


# `tokentop status`, then its own peak RSS since exec (VmHWM) into the file argv[1]: the kernel's
# ru_maxrss of a child also counts the test runner's memory it was forked from
STATUS_WITH_PEAK = """
import sys
from app.cli import main
try:
    code = main(sys.argv[2:])
finally:
    with open("/proc/self/status") as status:
        peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    with open(sys.argv[1], "w") as out:
        out.write(str(peak * 1024))
sys.exit(code)
"""


def _status_in_a_child(url: str) -> tuple[int, str, str, int, float]:
    """`tokentop status URL --json` in a subprocess: (rc, stdout, stderr, its peak RSS in bytes, seconds)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    peak_file = tempfile.NamedTemporaryFile(prefix="tokentop-peak-", delete=False).name
    proc = subprocess.Popen([sys.executable, "-c", STATUS_WITH_PEAK, peak_file, "status", url, "--json",
                             "--timeout", "10"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    killer = threading.Timer(60, proc.kill)
    killer.start()
    out, err = [], []
    readers = [threading.Thread(target=lambda s=s, b=b: b.append(s.read())) for s, b in
               ((proc.stdout, out), (proc.stderr, err))]
    for r in readers:
        r.start()
    proc.wait()
    killer.cancel()
    for r in readers:
        r.join()
    with open(peak_file) as f:
        peak = int(f.read() or 0)
    os.unlink(peak_file)
    return proc.returncode, out[0].decode(), err[0].decode(), peak, time.monotonic() - start


@pytest.mark.parametrize("page", [huge(declared=True), huge(declared=False),
                                  answer(GZIP_BOMB, headers={"Content-Encoding": "gzip"})],
                         ids=["declared", "undeclared", "gzip bomb"])
def test_status_json_of_a_500_mb_snapshot_stays_small_and_prints_none_of_it(page):
    with hostile_server({"/snapshot": page}) as url:
        rc, out, err, peak, took = _status_in_a_child(url)
    assert rc == 2 and out == "" and err.count("\n") == 1 and "16,777,216-byte limit" in err, err
    assert peak < RSS_LIMIT, f"peak RSS {peak / 2**20:.0f} MiB"
    assert took < 20, took


@pytest.mark.parametrize("snap", [{"version": 1}, {**SNAPSHOT, "workers": [{"name": ESC}]},
                                  {**SNAPSHOT, "latency": {"60s": ESC}}, {**SNAPSHOT, "workers": ESC}],
                         ids=["bare", "worker fields missing", "latency a string", "workers a string"])
def test_status_text_of_a_snapshot_of_another_shape_is_one_line(snap, capsys):
    with hostile_server({"/snapshot": answer(snap)}) as url:
        assert main(["status", url, "--timeout", str(TIMEOUT)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and _no_escape(err) and "Traceback" not in err, err
    assert "/snapshot does not have version 1's shape" in err and "same tokentop release" in err, err
