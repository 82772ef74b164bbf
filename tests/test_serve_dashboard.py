"""`tokentop --serve`: HTTP requests show live in the dashboard; remote workers' panels."""
from __future__ import annotations

import threading
import time
from dataclasses import replace

import httpx

from app.cli import build_dashboard_parser
from app.main import TokentopApp
from app.cli import start_dashboard_http
from app.widgets.worker import WorkerPanel
from engine.config import EngineConfig, WorkerConfig
from engine.facade.devices import parse_devices
from engine.facade.snapshot import EngineSnapshot, WorkerView
from tests.fixtures.tiny_gguf import write_tiny_model


def config(model, devices) -> EngineConfig:
    return EngineConfig(workers=parse_devices(devices, WorkerConfig(model=str(model))), worker_mode="thread")


async def wait_for(pilot, predicate, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await pilot.pause(0.05)


async def test_http_requests_appear_in_the_panels(tmp_path):
    model = write_tiny_model(tmp_path / "tiny.gguf", "qwen2")
    app = TokentopApp(config(model, ["sim:gpu0:prefill=20000,decode=100"]), settings_path=tmp_path / "s.json")
    http = start_dashboard_http(app, build_dashboard_parser().parse_args(["--serve", "127.0.0.1:0"]))
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.engine.ready, "the engine")
            async with httpx.AsyncClient(base_url=http.url, timeout=30) as c:
                r = await c.post("/v1/completions", json={"prompt": "hello from http", "max_tokens": 12})
                assert r.status_code == 200, r.text
            await wait_for(pilot, lambda: app.last_snapshot and any(
                q.state == "finished" and q.output_tokens == 12 for q in app.last_snapshot.requests),
                "the HTTP request in the request table")
            assert http.url in str(app._status.render())
            assert any("serving the OpenAI API" in line.text for line in app.last_snapshot.log)
    finally:
        http.stop()


def remote_view(url: str) -> WorkerView:
    return WorkerView(
        index=0, name="a", device=f"remote:{url}", model="qwen2.5-coder-0.5b", dtype="remote",
        simulated=False, state="ready", message="", running=2, waiting=1, prefill_tps=0.0, decode_tps=55.0,
        prefill_history=(0.0,), decode_history=(40.0, 55.0), pages_total=0, pages_used=0, page_states=b"",
        page_size=0, policy="remote", steps=0, profile_prefill_tps=900.0, profile_decode_tps=48.0, max_active=8,
        remote_url=url, kv_usage=0.25, note="prompt lengths: local tokenizer (same model)")


async def test_remote_worker_panel_shows_url_and_no_kv_grid(tmp_path):
    model = write_tiny_model(tmp_path / "tiny.gguf", "qwen2")
    url = "http://127.0.0.1:8001"
    app = TokentopApp(config(model, [f"remote:{url},name=a"]), settings_path=tmp_path / "s.json", live=False)
    async with app.run_test(size=(120, 40)) as pilot:
        snap = EngineSnapshot(time.time(), (remote_view(url),), (), (), "cost", (), False)
        app.show_snapshot(snap)
        await pilot.pause()
        panel = app.query_one(WorkerPanel)
        text = " ".join(str(line.render()) for line in panel.query("Line"))
        assert "remote" in text and url in text
        assert "no KV grid, KV 25% (scraped)" in text
        assert "prof 48" in text


async def test_a_typed_prompt_never_waits_on_a_slow_remote_tokenize(tmp_path, real_model_path):
    """A remote of another model whose /tokenize is slow: the prompt key's submit asks it off
    the UI's event loop, so the dashboard does not freeze for the timeout."""
    from tests.test_remote_tokenize import FakeRemote

    remote = FakeRemote("slow")
    app = TokentopApp(config(real_model_path, [f"remote:{remote.url},name=far", "sim:near:prefill=5000,decode=200"]),
                      settings_path=tmp_path / "s.json")
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.engine.ready and app.engine.needs_remote_counts(), "both workers")
            asked_from = []
            ask = app.engine.prompt_lengths

            def recording_ask(*args, **kwargs):
                asked_from.append(threading.current_thread())
                return ask(*args, **kwargs)

            app.engine.prompt_lengths = recording_ask
            app.submit_prompt("a prompt typed in the dashboard")
            await wait_for(pilot, lambda: app.last_snapshot and app.last_snapshot.routing, "the request, routed")
            assert asked_from and threading.main_thread() not in asked_from   # not the UI's loop
            far = app.last_snapshot.routing[-1].candidates[0]
            assert far.worker == 0 and far.prompt_source == "estimate"     # the slow call gave up
    finally:
        remote.stop()
