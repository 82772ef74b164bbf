"""Headless Chromium driven over the DevTools protocol, for tests of `tokentop web`: open a
page, wait for a script's condition, type keys, take a screenshot, read its text with OCR
(tesseract). Loopback only; every wait is bounded."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import re
import signal
import shutil
import subprocess
import tempfile
import time

import httpx

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
TESSERACT = shutil.which("tesseract")


@contextlib.contextmanager
def headless_chromium(width: int = 1280, height: int = 800):
    """A headless Chromium; yields its DevTools HTTP address."""
    profile = tempfile.TemporaryDirectory(prefix="tokentop-chromium-", ignore_cleanup_errors=True)
    proc = subprocess.Popen([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
                             f"--user-data-dir={profile.name}", f"--window-size={width},{height}",
                             "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            m = re.search(r"DevTools listening on ws://([^/]+)/", line)
            if m:
                yield f"http://{m.group(1)}"
                return
            if not line and proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {proc.returncode}")
        raise TimeoutError("chromium did not print its DevTools address")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)       # chromium's helper processes too
        proc.wait(10)
        profile.cleanup()


class Page:
    """One tab, driven by DevTools commands over its websocket."""

    def __init__(self, ws) -> None:
        self.ws, self.ids = ws, itertools.count(1)

    async def call(self, method: str, **params):
        msg_id = next(self.ids)
        await self.ws.send_str(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            reply = json.loads((await asyncio.wait_for(self.ws.receive(), 30)).data)
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    async def evaluate(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    async def wait_for(self, expression: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not await self.evaluate(expression):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page never satisfied {expression}")
            await asyncio.sleep(0.2)

    async def press(self, key: str, *, ctrl: bool = False) -> None:
        """One key, e.g. "p" with ctrl, as the keyboard would send it to the terminal."""
        await self.evaluate("document.querySelector('.xterm-helper-textarea').focus()")
        extra = {"modifiers": 2} if ctrl else {"text": key}
        code = ord(key.upper())
        for kind in ("keyDown", "keyUp"):
            await self.call("Input.dispatchKeyEvent", type=kind, key=key, code=f"Key{key.upper()}",
                            windowsVirtualKeyCode=code, **(extra if kind == "keyDown" else {}))

    async def screenshot(self) -> bytes:
        return base64.b64decode((await self.call("Page.captureScreenshot", format="png"))["data"])


@contextlib.asynccontextmanager
async def open_page(devtools: str, url: str):
    import aiohttp

    target = httpx.put(f"{devtools}/json/new?{url}", timeout=10).json()
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=64 * 2**20) as ws:
            yield Page(ws)


def ocr(png: bytes) -> str:
    """The text tesseract reads in a screenshot."""
    with tempfile.NamedTemporaryFile(suffix=".png") as f:
        f.write(png)
        f.flush()
        out = subprocess.run([TESSERACT, f.name, "-", "--psm", "6"], capture_output=True, text=True, timeout=60)
    return out.stdout
