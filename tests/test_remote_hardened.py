"""Remote workers against real local servers: an API key from the environment that never shows,
a stalled stream that fails clearly and degrades the worker, and https with a private CA.

The servers are real tokentop servers on simulated workers (the bundled model's tokenizer),
except the stalling one: a few lines of Starlette on loopback that answer health and models
and then send nothing, which is the failure under test.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from engine.config import EngineConfig, SamplingParams, WorkerConfig
from engine.errors import ConfigError
from engine.facade.devices import parse_devices
from engine.facade.engine import Engine
from engine.remote.spec import Secret
from engine.remote.tokens import TOKENIZE_OPENAI, RemoteTokenCounter
from engine.serve.server import bind
from tests.serve_util import in_process_server

KEY = "tt-secret-5b1e9c0f7d"          # what must never appear anywhere but the Authorization header
SIM = ["sim:r:prefill=20000,decode=2000"]


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def everything_said(engine, tmp_path) -> str:
    """Every text the engine shows or writes: its snapshot, log, config, routing log, trace."""
    snap = engine.snapshot()
    trace = engine.export_trace(tmp_path / "trace.json")
    return "\n".join([repr(snap), repr(engine.config), *(line.text for line in snap.log),
                      open(trace).read(), (tmp_path / "routing.jsonl").read_text()])


def front(model_path, devices, tmp_path, **kw) -> Engine:
    base = WorkerConfig(model=str(model_path), calibrate=False, max_active=4, **kw)
    return Engine(EngineConfig(workers=parse_devices(devices, base), worker_mode="thread",
                               routing_log=str(tmp_path / "routing.jsonl"), trace_dir=str(tmp_path)))


# --- api_key= ---------------------------------------------------------------------------------
def test_the_key_comes_from_the_environment_and_never_shows(real_model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("TT_REMOTE_KEY", KEY)
    monkeypatch.setenv("TT_WRONG_KEY", "tt-wrong-93a7c2e4")
    with in_process_server(real_model_path, SIM, api_key=KEY) as (_, backend):
        engine = front(real_model_path, [f"remote:{backend.url},name=good,api_key=TT_REMOTE_KEY",
                                         f"remote:{backend.url},name=bad,api_key=TT_WRONG_KEY",
                                         f"remote:{backend.url},name=none"], tmp_path).start(timeout=60)
        try:
            good, bad, none = engine.snapshot().workers
            assert good.state == "ready"
            assert bad.state == "down" and "refused the API key (401): check the key in $TT_WRONG_KEY" in bad.message
            assert none.state == "down" and "wants an API key" in none.message and "api_key=ENV_VAR" in none.message
            r = engine.submit("hello there", params=SamplingParams(max_tokens=4)).result(30)
            assert r.finish_reason == "length" and r.worker == 0 and len(r.token_ids) == 4
            said = everything_said(engine, tmp_path)
            assert "TT_REMOTE_KEY" in said                          # the variable's name may show
            assert KEY not in said and "tt-wrong-93a7c2e4" not in said
        finally:
            engine.shutdown()


def test_the_token_counter_sends_the_key(real_model_path, monkeypatch):
    monkeypatch.setenv("TT_REMOTE_KEY", KEY)
    with in_process_server(real_model_path, SIM, api_key=KEY) as (_, backend):
        model = backend.api.model
        with_key = RemoteTokenCounter(backend.url, Secret(parse_devices(
            [f"remote:{backend.url},api_key=TT_REMOTE_KEY"], WorkerConfig())[0].remote_options))
        without = RemoteTokenCounter(backend.url)
        try:
            assert with_key.count(TOKENIZE_OPENAI, model, "hello world", None, timeout=5) > 0
            with pytest.raises(ValueError, match="answered 401"):
                without.count(TOKENIZE_OPENAI, model, "hello world", None, timeout=5)
        finally:
            with_key.close()
            without.close()


@pytest.mark.parametrize("spec, words", [
    ("remote:http://h:1,api_key=TT_NOT_SET_ANYWHERE", "the environment has no TT_NOT_SET_ANYWHERE"),
    ("remote:http://h:1,api_key=sk-abc123", "names an environment variable"),
    ("remote:http://h:1,read_timeout=0", "read_timeout must be a positive number"),
    ("remote:http://h:1,read_timeout=soon", "read_timeout must be a positive number"),
    ("remote:https://h:1,ca=/no/such/ca.pem", "no such file"),
    ("remote:http://h:1,name=", "needs a value"),
])
def test_bad_remote_options_are_one_line(spec, words, monkeypatch):
    monkeypatch.delenv("TT_NOT_SET_ANYWHERE", raising=False)
    with pytest.raises(ConfigError, match=words):
        parse_devices([spec], WorkerConfig())


def test_the_key_error_names_the_variable_not_the_key(monkeypatch):
    monkeypatch.delenv("sk-abc123", raising=False)
    with pytest.raises(ConfigError) as e:
        parse_devices(["remote:http://h:1,api_key=sk-abc123"], WorkerConfig())
    assert "sk-abc123" in str(e.value)       # what was typed is echoed: it names no variable
    cfg = parse_devices(["remote:http://h:1,read_timeout=2.5"], WorkerConfig())[0]
    assert cfg.remote_options.read_timeout == 2.5 and cfg.device == "remote:http://h:1"


# --- read_timeout= --------------------------------------------------------------------------------
class StallingServer:
    """Healthy, serves `model`, and its completions stream `tokens_first` chunks and then stall
    (until `healed` is set, after which it answers promptly)."""

    def __init__(self, model: str, tokens_first: int):
        self.healed = threading.Event()
        self.release = threading.Event()

        async def health(_):
            return JSONResponse({"status": "ok"})

        async def models(_):
            return JSONResponse({"object": "list", "data": [{"id": model, "object": "model",
                                                                 "max_model_len": 256}]})

        async def complete(request):
            await request.json()
            if self.healed.is_set():
                return JSONResponse({"choices": [{"index": 0, "text": " ok", "finish_reason": "length"}]})

            async def chunks():
                for _ in range(tokens_first):
                    yield "data: " + json.dumps({"choices": [{"index": 0, "text": " tok", "token_ids": [11]}]}) + "\n\n"
                while not self.release.is_set():      # the stall: nothing more, connection open
                    await _sleep(0.05)

            return StreamingResponse(chunks(), media_type="text/event-stream")

        app = Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                                Route("/v1/completions", complete, methods=["POST"])])
        self.sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off",
                                                    timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()

    def stop(self):
        self.release.set()
        self.server.should_exit = True
        self.thread.join(5)


async def _sleep(s):
    import asyncio
    await asyncio.sleep(s)


@pytest.mark.parametrize("tokens_first", [0, 2])
def test_a_stalled_stream_fails_clearly_and_degrades_the_worker(tiny_model_path, tmp_path, tokens_first):
    model = tiny_model_path("qwen2")
    stub = StallingServer(model.stem, tokens_first)
    try:
        engine = front(model, [f"remote:{stub.url},name=slow,read_timeout=1"], tmp_path).start(timeout=30)
        try:
            assert engine.snapshot().workers[0].state == "ready"
            t0 = time.monotonic()
            r = engine.submit(prompt_ids=[5, 6, 7], params=SamplingParams(max_tokens=8)).result(20)
            assert time.monotonic() - t0 < 10
            assert r.finish_reason == "error"
            assert f"no data from {stub.url} for 1 s (read_timeout=1): the stream stalled" in r.error
            if tokens_first:
                assert "failed mid-stream" in r.error and r.text == " tok" * tokens_first
            else:                                   # nothing streamed: rerouted, and nowhere to go
                assert "no other worker is ready" in r.error
            w = engine.snapshot().workers[0]
            assert w.state == "degraded" and "stalled" in w.message
            time.sleep(2.5)                         # its probes see generation still stalling
            w = engine.snapshot().workers[0]
            assert w.state == "degraded" and "still generates nothing within read_timeout=1" in w.message
            stub.healed.set()
            wait_for(lambda: engine.snapshot().workers[0].state == "ready", 10, "re-admission")
            assert any("degraded: no data" in line.text for line in engine.snapshot().log)
        finally:
            engine.shutdown()
    finally:
        stub.stop()


# --- https ------------------------------------------------------------------------------------------
@pytest.fixture
def certificate(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("no openssl binary to make a test certificate with")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    return key, cert


def test_https_with_a_private_ca(real_model_path, tmp_path, certificate):
    key, cert = certificate
    with in_process_server(real_model_path, SIM) as (_, backend):
        sock = bind("127.0.0.1", 0)
        url = f"https://127.0.0.1:{sock.getsockname()[1]}"
        tls = uvicorn.Server(uvicorn.Config(backend.api.app, log_level="error", lifespan="off",
                                            ssl_keyfile=str(key), ssl_certfile=str(cert)))
        thread = threading.Thread(target=tls.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        try:
            engine = front(real_model_path, [f"remote:{url},name=tls,ca={cert}", f"remote:{url},name=untrusted"],
                           tmp_path).start(timeout=60)
            try:
                trusted, untrusted = engine.snapshot().workers
                assert trusted.state == "ready" and trusted.remote_url == url
                assert untrusted.state == "down" and "certificate" in untrusted.message.lower()
                r = engine.submit("over tls", params=SamplingParams(max_tokens=3)).result(30)
                assert r.finish_reason == "length" and r.worker == 0 and len(r.token_ids) == 3
            finally:
                engine.shutdown()
        finally:
            tls.should_exit = True
            thread.join(5)
