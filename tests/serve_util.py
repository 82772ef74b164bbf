"""Live `tokentop serve` servers on 127.0.0.1 for tests: in-process (engine inspectable) or a
real `tokentop serve` subprocess. Everything is bounded in time and loopback only."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from engine.config import EngineConfig, WorkerConfig
from engine.facade.devices import parse_devices
from engine.facade.engine import Engine
from engine.bench.llama_server import wait_healthy
from engine.serve.app import ServeConfig
from engine.serve.server import HttpServer

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def in_process_server(model_path, devices: list[str], *, max_active: int = 8, **serve):
    """An Engine (worker threads) behind an HttpServer thread on an ephemeral loopback port."""
    base = WorkerConfig(model=str(model_path), calibrate=False, max_active=max_active, threads=2,
                        max_context=serve.pop("max_context", 1024))
    engine = Engine(EngineConfig(workers=parse_devices(devices, base), worker_mode="thread"))
    http = HttpServer(engine, ServeConfig(port=0, **serve), quiet=True)
    try:
        engine.start()
        http.start()
        wait_healthy(http.url, 30)
        yield engine, http
    finally:
        http.stop()
        engine.shutdown()


class ServeProcess:
    """`python -m app.cli serve --port 0 ...` with its stderr captured; the URL read from it."""

    def __init__(self, args: list[str], timeout: float = 180.0):
        self.proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", "0", *args],
                                     cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        deadline = time.monotonic() + 30
        line = ""
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                self.url = m.group(1)
                break
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"tokentop serve exited with {self.proc.returncode}")
        else:
            self.stop()
            raise TimeoutError("tokentop serve did not print its address")
        self.lines: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        wait_healthy(self.url, timeout, self.proc)

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)   # its worker processes, if any were left
