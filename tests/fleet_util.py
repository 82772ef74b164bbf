"""Real fleet routers (vllm-router, SGLang's sglang-router) in front of real `tokentop serve`
processes, for tests: started on free loopback ports, their logs kept, stopped by their pid."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve_util import ServeProcess

MODEL = "qwen2.5-coder-0.5b"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def need(module: str, package: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{package} is not installed: pip install 'tokentop[fleet]'")


def tokentop(device: str, *extra: str, port: int | None = None) -> ServeProcess:
    args = ["--device", device, "--worker-mode", "thread", "--max-active", "8", "--model", MODEL,
            "--access-log", *extra]
    return ServeProcess(args + (["--port", str(port)] if port else []))


def port_of(server: ServeProcess) -> int:
    return int(server.url.rsplit(":", 1)[1])


def access_lines(server: ServeProcess) -> list[str]:
    """uvicorn's access log lines: '127.0.0.1:PORT - "POST /path HTTP/1.1" 200 OK'."""
    return [line for line in list(server.lines) if '" ' in line and "HTTP/" in line]


def samples(url: str) -> dict:
    text = httpx.get(url, timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(m: dict, name: str, **match) -> float:
    return sum(v for (n, labels), v in m.items()
               if n == name and all((k, want) in labels for k, want in match.items()))


class RouterProcess:
    """A router binary with its stdout and stderr in a file; `url` once it answers."""

    def __init__(self, argv: list[str], health: str, timeout: float = 60.0):
        self.port, self.metrics_port = free_port(), free_port()
        self.log = tempfile.NamedTemporaryFile("w+", prefix="router-", suffix=".log", delete=False)
        argv = [a.format(port=self.port, metrics_port=self.metrics_port) for a in argv]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "NO_COLOR": "1"})
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{argv[0]} exited with {self.proc.returncode}: {self.text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + health, timeout=2).status_code == 200:
                    return
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"{argv[0]} did not answer {health}: {self.text()[-2000:]}")

    def text(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def metrics(self) -> dict:
        return samples(f"http://127.0.0.1:{self.metrics_port}/metrics")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
        os.unlink(self.log.name)


def vllm_router(urls: list[str], *extra: str) -> RouterProcess:
    exe = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    return RouterProcess([exe, "--host", "127.0.0.1", "--port", "{port}", "--prometheus-port", "{metrics_port}",
                          "--worker-urls", *urls, *extra], health="/health")


def sglang_router(urls: list[str], *extra: str) -> RouterProcess:
    return RouterProcess([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                          "--port", "{port}", "--prometheus-port", "{metrics_port}", "--worker-urls", *urls,
                          *extra], health="/health")
