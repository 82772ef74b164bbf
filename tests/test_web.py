"""`tokentop web`: `watch` served to a browser by textual-serve, behind the page's guard.

The guard is tested over real HTTP against a real `tokentop web`; the page itself in headless
Chromium (Debian's `chromium`), whose screenshots are read with tesseract OCR. Those two skip
where either program is missing (.ci/run installs both when it can)."""
from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.browser_util import CHROMIUM, TESSERACT, headless_chromium, ocr, open_page
from tests.serve_util import ROOT, ServeProcess

pytest.importorskip("textual_serve")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WebProcess:
    """`python -m app.cli web ...` on a free loopback port, until its first line says it serves."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "app.cli", "web", *args, "--port", str(self.port)],
                                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = self.proc.stdout.readline()
        assert "tokentop web:" in line, line
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                httpx.get(self.url + "/static/css/xterm.css", timeout=2)
                return
            except httpx.TransportError:
                time.sleep(0.1)
        raise TimeoutError("tokentop web did not answer")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture
def served(tiny_model_path):
    server = ServeProcess(["--model", str(tiny_model_path("qwen2", context_length=1024)), "--worker-mode", "thread",
                           "--device", "sim:gpu0:prefill=20000,decode=2000"], timeout=60)
    try:
        yield server
    finally:
        server.stop()


def test_the_page_asks_for_its_key_and_then_holds_a_cookie():
    web = WebProcess("http://127.0.0.1:9", "--api-key", "s3cret")
    try:
        assert httpx.get(web.url + "/").status_code == 401
        assert httpx.get(web.url + "/?key=wrong").status_code == 401
        given = httpx.get(web.url + "/?key=s3cret")
        assert given.status_code == 302 and given.headers["location"] == "/"
        cookie = given.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "s3cret" not in cookie
        page = httpx.get(web.url + "/", cookies=given.cookies)
        assert page.status_code == 200 and "/ws" in page.text
        assert httpx.get(web.url + "/ws", cookies=given.cookies, headers={"Origin": "http://evil.example"}
                         ).status_code == 403
    finally:
        web.stop()


def test_on_loopback_the_page_answers_only_its_own_host_names():
    web = WebProcess("http://127.0.0.1:9")
    try:
        assert httpx.get(web.url + "/").status_code == 200
        refused = httpx.get(web.url + "/", headers={"Host": f"rebound.example:{web.port}"})
        assert refused.status_code == 403 and "rebound.example" in refused.text
    finally:
        web.stop()


@pytest.mark.parametrize("args, message", [
    (["--host", "0.0.0.0"], "add --api-key KEY"),
    (["--api-key", " "], "--api-key is empty"),
    (["--max-tabs", "0"], "--max-tabs must be at least 1"),
    (["--interval", "0"], "--interval must be a positive number"),
])
def test_bad_flags_are_one_line_errors(args, message):
    out = subprocess.run([sys.executable, "-m", "app.cli", "web", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.skipif(not (CHROMIUM and TESSERACT), reason="needs chromium and tesseract (apt-get install "
                                                           "chromium tesseract-ocr)")
def test_a_browser_shows_the_watched_workers_and_takes_keys(served, tmp_path):
    web = WebProcess(served.url)
    try:
        with headless_chromium() as devtools:
            first, palette = asyncio.run(_look_and_press(devtools, web.url))
    finally:
        web.stop()
    (tmp_path / "web.png").write_bytes(first)
    seen = ocr(first)
    assert _read_as(served.url.split("//")[1], seen), seen   # the watched server's group
    assert re.search(r"sim:gpu\S*\s+ready", seen), seen        # its worker, as watch draws it
    assert re.search(r"current theme", ocr(palette), re.I)    # ctrl+p reached the app: its command palette


def _read_as(expected: str, seen: str, misread: int = 1) -> bool:
    """expected is in OCR'd text, up to `misread` characters read wrong (it took a 1 for a 4)."""
    n = len(expected)
    return any(sum(a != b for a, b in zip(expected, seen[i:i + n])) <= misread
               for i in range(len(seen) - n + 1))


def test_ocr_text_matches_with_one_misread_character_not_two():
    seen = "http://127.0.0.1:44154 tokentop up"
    assert _read_as("127.0.0.1:44151", seen) and not _read_as("127.0.0.1:44111", seen)


async def _look_and_press(devtools: str, url: str) -> tuple[bytes, bytes]:
    async with open_page(devtools, url + "/") as page:
        await page.wait_for("document.body.classList.contains('-first-byte')", 30)
        first = await _screenshot_once(page, "ready", 20)
        await page.press("p", ctrl=True)
        await asyncio.sleep(1.5)
        return first, await page.screenshot()


async def _screenshot_once(page, word: str, timeout: float) -> bytes:
    """A screenshot, taken again until OCR reads `word` in it (the first look takes a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        png = await page.screenshot()
        if word in ocr(png) or time.monotonic() > deadline:
            return png
        await asyncio.sleep(0.5)


def test_docs_keep_one_screenshot():
    assert (Path(ROOT) / "docs" / "web.png").stat().st_size > 10_000


ORPHAN = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; from app.watch import exit_with_parent; "
                          f"exit_with_parent({os.getpid()}); time.sleep(60)"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(child.pid, flush=True)
os._exit(0)      # the parent goes without stopping its child, as a killed tokentop web does
"""


def test_a_tabs_watch_exits_when_the_page_server_is_gone():
    """A tab's watch outlived a killed `tokentop web`, spinning at a core's worth of CPU and deaf
    to SIGTERM; with the parent gone it now exits within a couple of seconds."""
    out = subprocess.run([sys.executable, "-c", ORPHAN], cwd=ROOT, capture_output=True, text=True, timeout=60)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid):
        assert time.monotonic() < deadline, "the orphaned watch is still running"
        time.sleep(0.2)


def _state(pid: int) -> str:
    try:
        return next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State"))
    except (OSError, StopIteration):
        return "zombie"


def test_tabs_run_watch_as_the_servers_own_child():
    from app.web import watch_command
    command = watch_command(["http://127.0.0.1:8000"], 1.0)
    assert command.startswith(f"TOKENTOP_EXIT_WITH_PARENT={os.getpid()} exec ") and " watch http://127.0.0.1:8000 " in command
