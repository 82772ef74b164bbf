"""The dashboard, driven through Textual's pilot against a real engine with simulated workers.

Simulated workers run the real scheduler, router and KV page accounting with a timed wait
instead of a forward pass; they need only a tokenizer, taken from a tiny random GGUF. They
run in threads here (the dashboard's default is one process per worker) to keep tests fast.
Snapshot tests render a hand-built EngineSnapshot, so no live timing can reach the picture.
"""
from __future__ import annotations

import gc
import json
import os
import random
import time
from pathlib import Path

import pytest

from dataclasses import replace

from textual.content import Content

from engine.stats import percentile
from app.cli import main as cli_main, startup_burst
from app.main import TokentopApp
from app.screens.burst import BurstDialog
from app.screens.detail import RequestDetail, detail_markup, prompt_markup
from app.screens.prompt import PromptDialog
from app.settings import Settings, load_settings, save_settings
from app.widgets import event_log
from app.widgets.worker import WorkerPanel
from app.widgets.kv_grid import CACHED, FREE, SHARED, USED, downsample, pages_per_cell
from app.widgets.line import Line
from app.widgets.requests import RequestsTable
from app.widgets.routing import format_decision
from app.widgets.streams import StreamsPanel
from app.widgets.timeline import TimelinePanel
from engine.config import EngineConfig, SamplingParams, WorkerConfig
from engine import messages as msg
from engine.facade import procstat
from engine.facade.devices import parse_devices
from engine.facade.latency import LatencyWindow
from engine.facade.router import Candidate, RouteDecision
from engine.facade.snapshot import EngineSnapshot, LogLine, RequestView, WorkerView
from engine.facade.timeline import Timeline
from tests.trace_checks import check_nesting
from tests.fixtures.tiny_gguf import write_tiny_model

SIZE = (120, 40)
# Fast enough for short tests, slow enough that a burst is still running while we look.
SIM_DEVICES = ["sim:gpu0:prefill=20000,decode=150", "sim:gpu1:prefill=20000,decode=150"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    # A long context: the sample prompts are ~1000 tokens in the tiny byte-level vocabulary.
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny.gguf", "qwen2", context_length=8192)


def sim_config(model: Path, trace_dir: Path | None = None) -> EngineConfig:
    base = WorkerConfig(model=str(model), kv_cache_memory=4 * 2**20)   # 512 pages of 16 tokens
    return EngineConfig(workers=parse_devices(SIM_DEVICES, base), worker_mode="thread",
                        trace_dir=str(trace_dir) if trace_dir else None)


def make_app(model: Path, tmp_path: Path, trace_dir: Path | None = None) -> TokentopApp:
    return TokentopApp(sim_config(model, trace_dir), settings_path=tmp_path / "settings.json")


async def wait_for(pilot, predicate, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await pilot.pause(0.05)


async def wait_ready(pilot, app: TokentopApp) -> None:
    await wait_for(pilot, lambda: app.last_snapshot is not None
                   and sum(w.state == "ready" for w in app.last_snapshot.workers) == 2, "both workers ready")


async def fire_burst(pilot, app: TokentopApp, **fields: str) -> None:
    await pilot.press("b")
    await wait_for(pilot, lambda: isinstance(app.screen, BurstDialog), "the burst dialog")
    for wid, value in fields.items():
        app.screen.query_one(f"#burst-{wid.replace('_', '-')}").value = value
    await pilot.press("enter")
    await wait_for(pilot, lambda: not isinstance(app.screen, BurstDialog), "the dialog to close")


def notices(app: TokentopApp) -> list[tuple[str, str]]:
    return [(n.severity, n.message) for n in app._notifications]


# --- live dashboard --------------------------------------------------------------------------
async def test_burst_fills_table_grid_streams_and_log(tiny_model, tmp_path):
    app = make_app(tiny_model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        grids_before = [p._grid._states for p in app.query(WorkerPanel)]
        assert all(set(states) == {FREE} for states in grids_before)

        await fire_burst(pilot, app, count="8", interval="20")
        table = app.query_one(RequestsTable)
        await wait_for(pilot, lambda: table.row_count == 8, "8 rows in the request table")
        await wait_for(pilot, lambda: any(set(p._grid._states) - {FREE} for p in app.query(WorkerPanel)),
                       "KV pages in use")
        await wait_for(pilot, lambda: app.query_one(StreamsPanel).shown_ids, "a token stream")
        assert "burst mixed#1" in str(app._status.render())
        # Requests reach both workers, and the routing panel explains each choice.
        await wait_for(pilot, lambda: {r.worker for r in app.last_snapshot.requests} == {0, 1}, "both workers used")
        assert "✓" in str(app.panels["routing"].body.render())

        await wait_for(pilot, lambda: any("burst mixed#1 done: 8 requests (8 ok" in line.text
                                          for line in app.last_snapshot.log), "the burst summary", timeout=30)
        # no page in use; the burst's published pages stay cached (reusable), drawn apart
        await wait_for(pilot, lambda: all(set(p._grid._states) <= {FREE, CACHED} for p in app.query(WorkerPanel)),
                       "every KV page free or cached again")
        assert any(CACHED in p._grid._states for p in app.query(WorkerPanel))
        summary = next(line.text for line in app.last_snapshot.log if "done:" in line.text)
        assert "TTFT mean" in summary and "p95" in summary and "tok/s aggregate" in summary
        assert any("done:" in line.text for line in app.panels["log"].lines)
        assert all(r.state == "finished" for r in app.last_snapshot.requests)


async def test_start_ups_objects_are_left_out_of_full_collections_while_the_dashboard_runs(tiny_model, tmp_path):
    app = make_app(tiny_model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        await wait_for(pilot, lambda: gc.get_freeze_count() > 0, "the heap settled")
    assert gc.get_freeze_count() == 0        # given back to the collector when the dashboard closes


async def test_policy_keys_reach_the_engine(tiny_model, tmp_path):
    app = make_app(tiny_model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        titles = [c.title for c in app.get_system_commands(app.screen)]
        assert {"Burst (b)", "Sched (p)", "Router (r)", "Abort (x / del)", "Trace (t)"} <= set(titles)
        await wait_ready(pilot, app)
        await pilot.press("p")
        assert app.scheduler_policy == "spf" and "sched spf" in str(app._status.render())
        await wait_for(pilot, lambda: all(w.policy == "spf" for w in app.last_snapshot.workers),
                       "workers reporting spf")
        await pilot.press("r")
        assert app.engine.router.policy == app.router_policy == "cache-aware"
        await pilot.press("r")
        assert app.engine.router.policy == app.router_policy == "round-robin"
        await pilot.press("ctrl+p", *"router", "enter")      # the command palette does the same
        await wait_for(pilot, lambda: app.router_policy == "least-loaded", "router policy via the palette")
        await wait_for(pilot, lambda: app.last_snapshot.router_policy == "least-loaded", "router policy in snapshot")
        await wait_for(pilot, lambda: sum("policy ->" in l.text for l in app.last_snapshot.log) == 4,
                       "policy changes in the event log")


async def test_t_writes_the_flight_recorder_with_every_request_of_the_burst(tiny_model, tmp_path, monkeypatch):
    """Tracing was never switched on: the light ring has the burst anyway, and the first t
    writes it (without --trace-dir, to ./traces)."""
    from tests.trace_checks import check_chrome_trace
    monkeypatch.chdir(tmp_path)
    traces = tmp_path / "traces"
    app = make_app(tiny_model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        assert not app.engine.tracing and "trace light" in str(app._status.render())
        await fire_burst(pilot, app, count="4", interval="0", max_tokens="8")
        await wait_for(pilot, lambda: len(app.last_snapshot.requests) == 4
                       and all(r.state == "finished" for r in app.last_snapshot.requests), "burst finished")
        await pilot.press("t")
        await wait_for(pilot, lambda: any(m.startswith("trace written to") for _, m in notices(app)),
                       "the trace path notification")
        ids = {r.id for r in app.last_snapshot.requests}
    written = list(traces.glob("*.json"))
    assert len(written) == 1
    # the absolute path, not one relative to wherever tokentop was started
    assert ("information", f"trace written to {written[0].resolve()}") in notices(app)
    document = json.loads(written[0].read_text())
    assert check_chrome_trace(document) == []
    events = document["traceEvents"]
    for rid in ids:
        phases = [e["name"] for e in events if e["ph"] == "X" and e.get("args", {}).get("request") == rid]
        assert phases[0] == "queued" and phases[-1] == "finished", (rid, phases)
    assert {e["args"]["request"] for e in events if e.get("name") == "route"} == ids
    assert {e["name"] for e in events if e["ph"] == "X"} >= {"engine step"}


async def test_shift_t_switches_detail_and_the_trace_dir_flag_starts_full(tiny_model, tmp_path):
    app = make_app(tiny_model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        await pilot.press("T")
        assert app.engine.tracing and "trace full" in str(app._status.render())
        assert ("information", "trace detail: full") in notices(app)
        await pilot.press("T")
        assert app.engine.recorder.detail == "light" and "trace light" in str(app._status.render())
    app = make_app(tiny_model, tmp_path, trace_dir=tmp_path / "t")
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        assert app.engine.tracing and "trace full" in str(app._status.render())


async def test_c_runs_an_ab_compare_and_shows_both_sides(tiny_model, tmp_path, monkeypatch):
    from app.screens.compare import CompareDialog, CompareResult
    from textual.widgets import Select
    monkeypatch.chdir(tmp_path)                   # the JSON report lands here
    app = make_app(tiny_model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        await pilot.press("c")
        await wait_for(pilot, lambda: isinstance(app.screen, CompareDialog), "the compare dialog")
        dialog = app.screen
        files = {p.name: p for p in dialog.files}
        dialog.query_one("#compare-file", Select).value = files["single_flight_2.jsonl"]
        dialog.query_one("#compare-a").value = "nonsense"
        await pilot.press("enter")
        assert "write KEY=VALUE" in str(dialog.query_one("#compare-error").render())   # the dialog stays
        dialog.query_one("#compare-a").value = "max-active=1"
        dialog.query_one("#compare-b").value = "max-active=2 router-policy=round-robin"
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, CompareResult), "the compare result", timeout=60)
        text = app.screen.text
        assert "A: max-active=1" in text and "B: max-active=2 router-policy=round-robin" in text
        assert "TTFT p95" in text and "sf2-2" in text
        await pilot.press("escape")
        assert not isinstance(app.screen, CompareResult)
    reports = list(tmp_path.glob("compare-*.json"))
    assert len(reports) == 1 and json.loads(reports[0].read_text())["requests"] == 2


async def test_abort_selected_request_and_detail(tiny_model, tmp_path):
    app = make_app(tiny_model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        await pilot.press("x")
        assert ("warning", "no request selected: pick one in the request table") in notices(app)
        await fire_burst(pilot, app, count="3", interval="0", max_tokens="4000")
        table = app.query_one(RequestsTable)
        await wait_for(pilot, lambda: table.row_count == 3, "three rows")
        states = lambda: {r.id: r.state for r in app.last_snapshot.requests}  # noqa: E731
        await pilot.press("home")    # the cursor follows its request as rows arrive: go to the top
        assert table.selected_id == "r3"                  # newest first
        await pilot.press("down")
        victim = table.selected_id
        assert victim == "r2"
        await pilot.press("x")
        await wait_for(pilot, lambda: states()[victim] == "aborted", f"{victim} aborted")
        assert states()["r1"] in ("prefill", "decode") and states()["r3"] in ("prefill", "decode")
        await pilot.press("x")                            # the cursor is still on the aborted request
        assert ("warning", f"{victim} has already finished") in notices(app)
        # Enter opens the request in full; x there aborts it too.
        await pilot.press("down", "enter")
        await wait_for(pilot, lambda: isinstance(app.screen, RequestDetail), "the detail screen")
        fields = str(app.screen.query_one("#detail-fields").render())
        assert "prompt tokens" in fields and "of 4000" in fields
        await pilot.press("x")
        await wait_for(pilot, lambda: states()["r1"] == "aborted", "r1 aborted")
        await pilot.press("escape")
        assert not isinstance(app.screen, RequestDetail)


async def test_quit_mid_burst_is_quick(tiny_model, tmp_path):
    app = make_app(tiny_model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        await fire_burst(pilot, app, count="1000", interval="10", max_tokens="2000")
        await wait_for(pilot, lambda: app.query_one(RequestsTable).row_count >= 5, "a running burst")
        run = app.bursts[0]
        started = time.monotonic()
        await pilot.press("q")
    app.wait_for_shutdown(timeout=10)
    assert time.monotonic() - started < 5
    assert not app._shutdown_thread.is_alive()
    submitted = run.submitted
    run._thread.join(1)
    assert not run._thread.is_alive() and run.submitted == submitted < 1000   # it stopped submitting
    assert all(w.state in ("stopped", "dead") for w in app.engine.snapshot().workers)


async def test_bad_input_is_a_notification_not_a_traceback(tiny_model, tmp_path):
    app = make_app(tiny_model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        await pilot.press("n")
        await wait_for(pilot, lambda: isinstance(app.screen, PromptDialog), "the prompt dialog")
        await pilot.press("enter")              # empty prompt
        await wait_for(pilot, lambda: ("error", "the prompt is empty; type some text") in notices(app),
                       "the refusal")
        # A prompt longer than the context is refused with the engine's message.
        await pilot.press("n")
        await wait_for(pilot, lambda: isinstance(app.screen, PromptDialog), "the prompt dialog")
        app.screen.query_one("#prompt-text").value = "word " * 9000
        await pilot.press("enter")
        await wait_for(pilot, lambda: any("shorten the prompt" in m for _, m in notices(app)), "context refusal")
        # Bad dialog fields stay in the dialog with a message.
        await pilot.press("b")
        await wait_for(pilot, lambda: isinstance(app.screen, BurstDialog), "the burst dialog")
        app.screen.query_one("#burst-count").value = "0"
        await pilot.press("enter")
        assert isinstance(app.screen, BurstDialog)
        assert "count must be between 1 and 10000" in str(app.screen.query_one("#burst-error").render())
        await pilot.press("escape")
        # A good prompt goes through and streams.
        await pilot.press("n")
        await wait_for(pilot, lambda: isinstance(app.screen, PromptDialog), "the prompt dialog")
        app.screen.query_one("#prompt-text").value = "Hello there"
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.last_snapshot.requests) == 1, "one request")
        assert app.last_snapshot.requests[0].prompt_tokens == len(app.engine.tokenizer.encode("Hello there"))


async def test_engine_start_failure_is_shown(tmp_path):
    app = TokentopApp(EngineConfig(workers=parse_devices(["sim:gpu0"], WorkerConfig(model=str(tmp_path / "nope.gguf"))),
                                   worker_mode="thread"), settings_path=tmp_path / "settings.json")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: any(s == "error" for s, _ in notices(app)), "an error notification")
        panel = app.query_one(WorkerPanel)
        await wait_for(pilot, lambda: panel.has_class("-dead"), "the panel marked dead")
        await pilot.press("b", "enter")
        assert any("nope.gguf" in m for _, m in notices(app))


async def test_model_assembly_progress_is_shown(tiny_model, tmp_path):
    app = TokentopApp(sim_config(tiny_model), settings_path=tmp_path / "settings.json", live=False)
    async with app.run_test(size=SIZE) as pilot:
        app._on_progress(str(tiny_model), 100 * 2**20, 400 * 2**20)     # the engine's progress callback
        app.show_snapshot(app.engine.snapshot())                        # not started: no workers yet
        await pilot.pause()
        for panel in app.query(WorkerPanel):
            # the model's name on the first line, the progress on its own line (never cut at 80 columns)
            assert "loading" in str(panel._identity_line.render()) and "tiny.gguf" in str(panel._identity_line.render())
            assert str(panel._load.render()) == "assembling the model file: 100/400 MiB"
            assert panel._bar.display and panel._bar.percentage == 0.25


async def test_theme_switch_is_remembered(tiny_model, tmp_path):
    settings = tmp_path / "settings.json"
    settings.write_text("{ not json")          # a corrupt file means defaults
    app = TokentopApp(sim_config(tiny_model), settings_path=settings, live=False)
    async with app.run_test(size=SIZE) as pilot:
        assert app.theme == "tokentop-dark"
        await pilot.press("d")
        assert app.theme == "tokentop-light"
    assert load_settings(settings).theme == "tokentop-light"
    again = TokentopApp(sim_config(tiny_model), settings_path=settings, live=False)
    async with again.run_test(size=SIZE):
        assert again.theme == "tokentop-light"
    untouched = tmp_path / "untouched.json"        # no switch, no write
    async with TokentopApp(sim_config(tiny_model), settings_path=untouched, live=False).run_test(size=SIZE) as pilot:
        await pilot.pause()
    assert not untouched.exists()


def test_settings_tolerate_bad_files(tmp_path):
    path = tmp_path / "sub" / "settings.json"
    assert load_settings(path) == Settings()
    save_settings(Settings(theme="nord"), path)
    assert load_settings(path).theme == "nord"
    path.write_text('["a list"]')
    assert load_settings(path) == Settings()
    path.write_text('{"theme": 7}')
    assert load_settings(path) == Settings()


def test_command_line_errors_are_one_line(capsys):
    assert cli_main(["--device", "tpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown device 'tpu'" in err
    with pytest.raises(SystemExit) as exc:
        cli_main(["--no-such-flag"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1



@pytest.mark.parametrize("flags, fragment", [
    # the dashboard serves the API with --serve only: alone, these flags would do nothing
    (["--port", "9000"], "--port applies to the API server, which the dashboard runs with --serve only; "
                         "add e.g. --serve 9000"),
    (["--api-key", "k"], "--api-key applies to the API server"),
    (["--serve", "8001", "--port", "9000"], "--serve names the port ([HOST:]PORT); drop --port 9000"),
])
def test_server_flags_without_serve_are_one_line(capsys, monkeypatch, flags, fragment):
    def refuse(self):
        raise AssertionError("the dashboard started despite the flags")
    monkeypatch.setattr(TokentopApp, "run", refuse)
    assert cli_main(["--device", "sim:gpu0", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err, err


def test_percentile_is_nearest_rank():
    assert percentile([3.0], 95) == 3.0
    assert percentile([float(v) for v in range(20, 0, -1)], 95) == 19.0
    assert percentile([1.0, 2.0], 50) == 1.0 and percentile([1.0, 2.0], 51) == 2.0


def test_kv_grid_downsampling_keeps_the_notable_state():
    assert pages_per_cell(10, 100) == 1 and pages_per_cell(1000, 100) == 10 and pages_per_cell(1001, 100) == 11
    states = bytes([FREE, FREE, CACHED, FREE, USED, CACHED, SHARED, USED, FREE])
    assert downsample(states, 1) == list(states)
    assert downsample(states, 2) == [FREE, CACHED, USED, SHARED, FREE]
    assert downsample(states, 4) == [CACHED, SHARED, FREE]


# --- issue 15: dead workers, selection, burst files, narrow terminals, labels, traces --------------
async def test_dead_worker_greys_its_panel_and_its_failed_requests_keep_their_figures(tiny_model, tmp_path):
    app = make_app(tiny_model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        await fire_burst(pilot, app, count="4", interval="0", max_tokens="4000")
        on_w1 = lambda: [r for r in app.last_snapshot.requests if r.worker == 1]  # noqa: E731
        await wait_for(pilot, lambda: on_w1() and all(r.output_tokens > 2 for r in on_w1()), "tokens on worker 1")
        app.engine.workers[1].send(msg.Stop())   # its loop ends: to the engine, a worker that died
        panel = app.query(WorkerPanel)[1]
        await wait_for(pilot, lambda: panel.has_class("-dead"), "worker 1's panel marked dead")
        await pilot.pause(0.3)
        failed = [r for r in app.last_snapshot.requests if r.worker == 1]
        assert failed and all(r.state == "error" and r.finish_reason == "error" for r in failed)
        # They produced tokens before the worker died: their TTFT and ITL are kept.
        assert all(r.ttft is not None and r.itl_mean is not None for r in failed)
        table = app.query_one(RequestsTable)
        row = table.row_cells(failed[0].id)
        assert row[4] != "-" and "died" in row[7]                       # TTFT, and the end column
        # Its live figures are gone or labelled, not frozen at their last values.
        text = " ".join(str(line.render()) for line in panel.query(Line))
        assert "● dead" in text and "worker process exited" in text and "run " not in text
        assert "— tok/s" in text and "KV —" in text and "%" not in text
        assert panel._grid._states == b"" and panel._decode_spark._samples == ()


async def test_selection_follows_the_newest_live_request_and_stays_visible(tiny_model, tmp_path):
    app = make_app(tiny_model, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_ready(pilot, app)
        await fire_burst(pilot, app, count="8", interval="30", max_tokens="4000")
        table = app.query_one(RequestsTable)
        await wait_for(pilot, lambda: table.row_count == 8, "eight rows")
        await pilot.pause(0.3)
        live = [r for r in app.last_snapshot.requests if r.state in ("queued", "prefill", "decode")]
        newest_live = max(live, key=lambda r: int(r.id[1:])).id
        assert table.selected_id == newest_live == "r8"

        def cursor_visible() -> bool:
            top = int(table.scroll_y)
            return top <= table._cursor < top + table.size.height - 1
        assert cursor_visible()
        # Once moved, the cursor keeps its request, and the row stays in view while newer
        # requests push it down.
        await pilot.press("end")
        assert table.selected_id == "r1" and cursor_visible()
        await fire_burst(pilot, app, count="8", interval="0", max_tokens="4000")
        await wait_for(pilot, lambda: table.row_count == 16, "sixteen rows")
        await pilot.pause(0.3)
        assert table.selected_id == "r1" and cursor_visible()
        await pilot.press("x")
        await wait_for(pilot, lambda: ("information", "aborting r1") in notices(app), "r1 aborted")


BAD_BURST = '{"prompt": "fine"}\n{"prompt": "x", "max_tokens": "many"}\n'


async def test_burst_dialog_takes_a_path_and_shows_the_files_mistakes(tiny_model, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(BAD_BURST)
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"prompt": "Hello there", "max_tokens": 5}\n{"prompt": "Count to three"}\n')
    app = make_app(tiny_model, tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        await pilot.press("b")
        await wait_for(pilot, lambda: isinstance(app.screen, BurstDialog), "the burst dialog")
        app.screen.query_one("#burst-path").value = str(bad)
        await pilot.press("enter")
        assert isinstance(app.screen, BurstDialog)                       # stays open
        error = str(app.screen.query_one("#burst-error").render())
        assert f"{bad}:2" in error and '"max_tokens" must be an integer' in error
        app.screen.query_one("#burst-path").value = str(tmp_path / "missing.jsonl")
        await pilot.press("enter")
        assert "Burst file not found" in str(app.screen.query_one("#burst-error").render())
        app.screen.query_one("#burst-path").value = str(mine)
        app.screen.query_one("#burst-count").value = "2"
        await pilot.press("enter")
        await wait_for(pilot, lambda: not isinstance(app.screen, BurstDialog), "the dialog to close")
        await wait_for(pilot, lambda: len(app.last_snapshot.requests) == 2, "two requests")
        assert "burst mine#1" in str(app._status.render()) or any("burst mine#1" in l.text
                                                                   for l in app.last_snapshot.log)
        assert {r.prompt for r in app.last_snapshot.requests} == {"Hello there", "Count to three"}


async def test_burst_file_flag_fires_at_start_up(tiny_model, tmp_path, capsys):
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"prompt": "Hello there", "max_tokens": 5}\n{"prompt": "Count to three", "max_tokens": 7}\n'
                    '{"prompt": "Name a colour", "max_tokens": 3}\n')
    app = TokentopApp(sim_config(tiny_model), settings_path=tmp_path / "settings.json",
                      startup_burst=startup_burst(str(mine)))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.last_snapshot is not None and len(app.last_snapshot.requests) == 3,
                       "the file's three requests, without a key pressed")
        # each line once, with its own max_tokens
        assert sorted(r.max_tokens for r in app.last_snapshot.requests) == [3, 5, 7]
    # A bad file is a one-line error before anything loads.
    bad = tmp_path / "bad.jsonl"
    bad.write_text(BAD_BURST)
    assert cli_main(["--burst-file", str(bad), "--device", "sim:gpu0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{bad}:2" in err


async def test_narrow_terminal_keeps_burst_progress_in_the_header(tiny_model, tmp_path):
    app = make_app(tiny_model, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_ready(pilot, app)
        await fire_burst(pilot, app, count="50", interval="100", max_tokens="8")
        await wait_for(pilot, lambda: app.bursts and app.bursts[0].submitted > 2, "a burst in progress")
        app._show_status()
        await pilot.pause()
        header = str(app._status.render())
        assert "burst mixed#1" in header and "/50" in header and "…" not in header
        assert len(header) <= 80
        # Worker panels: a unit on every rate; CPU% measured for each worker.
        panel = app.query(WorkerPanel)[0]
        assert str(panel._decode_label.render()).endswith("tok/s")
        await wait_for(pilot, lambda: all(w.cpu_percent is not None for w in app.last_snapshot.workers),
                       "CPU% of every worker")


async def test_loading_message_is_not_cut_at_80_columns(tiny_model, tmp_path):
    app = TokentopApp(sim_config(tiny_model), settings_path=tmp_path / "settings.json", live=False)
    message = "measuring prefill / decode speed (first use only)"
    async with app.run_test(size=(80, 24)) as pilot:
        ready = fixture_snapshot().workers[0]
        loading = replace(ready, index=1, state="loading", message=message)
        app.show_snapshot(replace(fixture_snapshot(), workers=(ready, loading)))
        await pilot.pause()
        panel = app.query(WorkerPanel)[1]
        assert str(panel._load.render()) == message
        assert panel._load.size.height == 2 and len(message) <= 2 * panel._load.size.width
        assert app.query(WorkerPanel)[0]._load.size.height == 1      # a ready worker's figures: one line


def test_cpu_percent_and_rss_come_from_proc(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    def write_stat(utime: int, stime: int) -> None:   # a command name with spaces and parentheses
        stat.write_text(f"42 (tokentop (w 1)) S 1 2 3 4 5 6 7 8 9 10 {utime} {stime} 0 0 20 0 1\n")
    write_stat(100, 50)
    assert procstat.cpu_seconds(str(stat)) == 150 / procstat._TICKS
    clock = [1000.0]
    monkeypatch.setattr(procstat.time, "monotonic", lambda: clock[0])
    real = procstat.cpu_seconds
    monkeypatch.setattr(procstat, "cpu_seconds", lambda path: real(str(stat)))     # any thread reads our file
    sampler = procstat.UsageSampler()
    assert sampler.sample("w", None, thread_id=1) == (None, None)       # first reading: no rate yet
    write_stat(100 + procstat._TICKS // 2, 50 + procstat._TICKS // 2)  # +1.0 s of CPU
    clock[0] += 2.0                                                    # over 2 s of wall time
    assert sampler.sample("w", None, thread_id=1) == (50.0, None)
    assert procstat.rss_bytes(os.getpid()) > 0


def test_routing_lines_name_their_figures():
    cands = tuple(Candidate(i, f"sim:gpu{i}", 2, 1, 200, 300, 16, 20000.0, 400.0, s)
                  for i, s in enumerate((0.61, 0.74)))
    cost = format_decision(RouteDecision("r5", 0.0, "cost", 0, 100, 64, cands))
    first = cost.splitlines()[1]
    assert "gpu0" in first and first.index("est 610ms") < first.index("prefill 200 tok") < first.index("decode 300 tok")
    assert "run 2 wait 1" in first and "reuse ~16 tok" in first and "20k/400 tok/s" in first
    aware = format_decision(RouteDecision("r5", 0.0, "cache-aware", 0, 100, 64, cands, "longest prefix"))
    assert "cache-aware (longest prefix)" in aware and "est 610ms" in aware
    rr = format_decision(RouteDecision("r5", 0.0, "round-robin", 1, 100, 64,
                                       tuple(replace(c, score=0.0) for c in cands)))
    assert all("(no score)" in line for line in rr.splitlines()[1:]) and "est" not in rr and " 0 " not in rr
    narrow = format_decision(RouteDecision("r5", 0.0, "cost", 0, 100, 64, cands), width=26)
    assert all(len(Content.from_markup(line).plain) <= 26 for line in narrow.splitlines())
    assert "est 610ms" in narrow


def test_routing_and_detail_say_where_a_remotes_prompt_length_came_from():
    local = Candidate(0, "cpu", 0, 0, 10, 5, 0, 100.0, 10.0, 0.6, prompt_tokens=10)
    theirs = Candidate(1, "far", 0, 0, 14, 5, 0, 100.0, 10.0, 0.7, prompt_tokens=14, prompt_source="remote")
    guess = Candidate(2, "far2", 0, 0, 10, 5, 0, 100.0, 10.0, 0.8, prompt_tokens=10, prompt_source="estimate")
    lines = format_decision(RouteDecision("r1", 0.0, "cost", 0, 10, 5, (local, theirs, guess))).splitlines()
    assert "prompt" not in lines[1]                      # our own count needs no label
    assert "prompt 14 tok (its /tokenize)" in lines[2]
    assert "prompt ~10 tok (estimate)" in Content.from_markup(lines[3]).plain
    view = fixture_snapshot().requests[0]
    assert "(counted by the remote's /tokenize)" in detail_markup(replace(view, prompt_source="remote"), "far")
    assert "(estimate" in detail_markup(replace(view, prompt_source="estimate"), "far")
    assert "(estimate" not in detail_markup(view, "cpu")


def test_detail_shows_prompt_sampling_end_and_worker_name():
    view = fixture_snapshot(dead=True).requests[3]
    fields = detail_markup(replace(view, params=SamplingParams(max_tokens=64, temperature=0.7, top_k=40)),
                           "sim:gpu1")
    assert "sim:gpu1" in fields and "temperature 0.7" in fields and "top k 40" in fields
    assert "died" in fields
    assert "length (max tokens reached)" in detail_markup(fixture_snapshot().requests[0], "sim:gpu0")
    assert "prompt 4" in prompt_markup(view)
    assert "lowered to 447" in detail_markup(replace(view, notice="max_tokens 20000 lowered to 447"), "sim:gpu1")


async def test_dashboard_trace_has_lifecycles_preemptions_and_routing(tiny_model, tmp_path):
    # Little KV memory (64 pages) and long outputs: requests get preempted.
    base = WorkerConfig(model=str(tiny_model), kv_cache_memory=64 * 8192)
    config = EngineConfig(workers=parse_devices(["sim:fast:prefill=50000,decode=2000"], base),
                          worker_mode="thread", trace_dir=str(tmp_path / "traces"), router_policy="round-robin")
    app = TokentopApp(config, settings_path=tmp_path / "settings.json")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine.ready, "the worker")
        app.engine.set_tracing(False)
        # Requests that start before tracing is turned on still show up while they run.
        early = [app.engine.submit("early request number one", params=SamplingParams(max_tokens=600, ignore_eos=True))]
        await pilot.pause(0.2)
        app.engine.set_tracing(True)
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        late = [app.engine.submit(f"request {i} " * 10, params=params) for i in range(4)]
        await wait_for(pilot, lambda: any("preempted" in l.text for l in app.last_snapshot.log), "a preemption")
        # the worker's panel shows the tokens it had to compute again
        panel = app.query_one(WorkerPanel)
        await wait_for(pilot, lambda: "recomputed" in str(panel._load.render()), "recomputed tokens in the panel")
        await pilot.press("t")
        await wait_for(pilot, lambda: any(m.startswith("trace written to") for _, m in notices(app)),
                       "the trace")
        for h in early + late:
            h.abort()
    path = next(m for _, m in notices(app) if m.startswith("trace written to"))[len("trace written to "):]
    assert Path(path).is_absolute()
    events = json.loads(Path(path).read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {f"req {h.id}" for h in early + late} <= tracks
    phases = {e["name"] for e in events if e.get("ph") == "X" and e.get("args", {}).get("request") == early[0].id}
    assert "decode" in phases                                   # it was decoding in the window
    assert any(e.get("ph") == "i" and e["name"] == "preempted" for e in events)
    routed = {e["args"]["request"] for e in events if e.get("ph") == "i" and e["name"] == "route"}
    assert routed == {h.id for h in early + late}               # the light ring records routing too
    assert check_nesting(events) == []


# --- snapshots ---------------------------------------------------------------------------------
def fixture_snapshot(dead: bool = False) -> EngineSnapshot:
    """A busy moment, built by hand: every page state, every request state, two decisions;
    dead=True: worker 1 has died and its requests failed."""
    pages0 = bytes([USED] * 40 + [SHARED] * 12 + [CACHED] * 30 + [FREE] * 430)
    pages1 = bytes([USED] * 90 + [FREE] * 400 + [CACHED] * 22)

    def worker(i: int, pages: bytes, running: int, waiting: int, history: tuple[float, ...]) -> WorkerView:
        gone = dead and i == 1
        return WorkerView(
            index=i, name=f"sim:gpu{i}", device=f"sim:gpu{i}", model="tiny.gguf", dtype="simulated",
            simulated=True, state="dead" if gone else "ready",
            message="worker process exited (exit code -9)" if gone else "", running=running,
            waiting=waiting, prefill_tps=history[-1] * 8, decode_tps=history[-1],
            prefill_history=tuple(h * 8 for h in history), decode_history=history,
            pages_total=len(pages), pages_used=sum(p != FREE for p in pages), page_states=pages,
            page_size=16, policy="fcfs", steps=1234, profile_prefill_tps=20000.0,
            profile_decode_tps=400.0, max_active=8, kv_bytes=len(pages) * 16 * 1536,
            cpu_percent=97.0 + i, rss_bytes=(612 + 40 * i) * 2**20, recomputed_tokens=0 if i else 1200,
            prefix_cache=True, hit_rate=0.83 - 0.5 * i,
            prefix={"prefix_cache_queries": 1000, "prefix_cache_hits": 830, "cached_pages": pages.count(CACHED),
                    "evictions": 7 * i, "single_flight_waits": 3 - i})

    def request(n: int, w: int, state: str, out: int, text: str, ttft=None, itl=None, e2e=0.5,
                error=None, reason=None, leader=None) -> RequestView:
        return RequestView(id=f"r{n}", worker=w, state=state, prompt_tokens=100 + n, cached_tokens=16 * (n % 2),
                           output_tokens=out, max_tokens=64, queue_time=0.001, ttft=ttft, itl_mean=itl,
                           e2e=e2e, text_tail=text, error=error, burst="mixed#1", age=10.0 - n,
                           finish_reason=reason, prompt=f"prompt {n}", params=SamplingParams(max_tokens=64),
                           leader=leader)

    def decision(n: int, chosen: int, scores: tuple[float, float]) -> RouteDecision:
        return RouteDecision(f"r{n}", 1000.0 + n, "cache-aware", chosen, 100 + n, 64, tuple(
            Candidate(i, f"sim:gpu{i}", 2 + i, i, 200 + 50 * i, 300 + 20 * i, 96 * (1 - i), 20000.0, 400.0, s)
            for i, s in enumerate(scores)), "longest prefix")

    t0 = 1_700_000_000.0
    return EngineSnapshot(
        time=t0,
        workers=(worker(0, pages0, 3, 1, (0, 120.0, 310.0, 390.0, 402.0, 398.0)),
                 worker(1, pages1, 2, 0, (0, 0, 80.0, 200.0, 260.0, 255.0))),
        requests=(request(1, 0, "finished", 64, "The capital of France is Paris.", 0.021, 0.012, 0.79,
                          reason="length"),
                  request(2, 1, "error", 3, "abc", 0.03, None, 0.2, error="model step failed", reason="error"),
                  request(3, 0, "aborted", 10, " once upon", 0.02, 0.01, 0.3, reason="abort"),
                  request(4, 1, "decode", 17, " def tokens(self):\n    return self._ids", 0.04)
                  if not dead else
                  request(4, 1, "error", 17, " def tokens(self):\n    return self._ids", 0.04, 0.011, 0.6,
                          error="worker 1 (sim:gpu1) died: worker process exited (exit code -9)",
                          reason="error"),
                  request(5, 0, "prefill", 0, ""),
                  request(6, 0, "queued", 0, "", leader="r5")),
        routing=(decision(5, 0, (0.61, 0.74)), decision(6, 0, (0.83, 0.90))),
        router_policy="cost",
        log=(LogLine(t0, "info", "worker 0 (sim:gpu0) ready: 512 KV pages of 16 tokens"),
             LogLine(t0 + 1, "warning", "r3 preempted on worker 0 (will recompute)"),
             LogLine(t0 + 2, "error", "r2: model step failed"),
             LogLine(t0 + 3, "info", "burst mixed#0 done: 8 requests (8 ok, 0 failed, 0 aborted), "
                                     "TTFT mean 42 ms p95 80 ms, 812 tok/s aggregate over 1.2 s")),
        tracing=False, uptime=125.0, latency=fixture_latency(dead))


def fixture_latency(dead: bool = False) -> dict:
    """Percentiles of 40 made-up requests over the last minute, seeded: the same every run."""
    rng = random.Random(7)
    window = LatencyWindow()
    for i in range(40):
        worker, t = i % 2, 1000.0 - rng.uniform(0, 55)
        queue, ttft, itl = rng.lognormvariate(-6, 1), rng.lognormvariate(-3.5, 0.6), rng.lognormvariate(-4.5, 0.3)
        window.add([("queue", worker, t, queue), ("ttft", worker, t, ttft), ("itl", worker, t, itl),
                    ("e2e", worker, t, ttft + 63 * itl)])
    return window.views(1000.0)


@pytest.fixture
def frozen_app(tiny_model, tmp_path, monkeypatch) -> TokentopApp:
    monkeypatch.setattr(event_log, "format_clock", lambda t: time.strftime("%H:%M:%S", time.gmtime(t)))
    return TokentopApp(sim_config(tiny_model), settings_path=tmp_path / "settings.json", live=False)


def test_snapshot_main_screen(frozen_app, snap_compare):
    async def show(pilot):
        frozen_app.show_snapshot(fixture_snapshot())
        await pilot.pause()
    assert snap_compare(frozen_app, terminal_size=SIZE, run_before=show)


def test_snapshot_main_screen_small(frozen_app, snap_compare):
    async def show(pilot):
        frozen_app.show_snapshot(fixture_snapshot())
        await pilot.pause()
    assert snap_compare(frozen_app, terminal_size=(80, 24), run_before=show)


def test_snapshot_dead_worker_small(frozen_app, snap_compare):
    """80x24 with a dead worker: its panel greyed with cleared figures, failed requests keep TTFT."""
    async def show(pilot):
        frozen_app.show_snapshot(fixture_snapshot(dead=True))
        await pilot.pause()
    assert snap_compare(frozen_app, terminal_size=(80, 24), run_before=show)


async def test_the_event_log_shows_engine_settings_as_flags(frozen_app):
    """The engine's lines name settings by field (`kv_cache_memory`); the dashboard, run from
    the command line, names the flags."""
    line = LogLine(time.time(), "error", "r1: raise `kv_cache_memory` or lower max_tokens")
    async with frozen_app.run_test(size=SIZE) as pilot:
        frozen_app.show_snapshot(replace(fixture_snapshot(), log=(line,)))
        await pilot.pause()
        shown = " ".join(strip.text.strip() for strip in frozen_app.panels["log"].lines)   # wrapped lines
    assert "r1: raise --kv-cache-memory or lower max_tokens" in shown, shown


def test_snapshot_burst_dialog(frozen_app, snap_compare):
    assert snap_compare(frozen_app, terminal_size=SIZE, press=["b"])


def test_snapshot_help_screen(frozen_app, snap_compare):
    assert snap_compare(frozen_app, terminal_size=SIZE, press=["question_mark"])


async def test_the_worker_panel_says_which_path_runs_and_when_the_kernels_took_over(frozen_app):
    """First use: the worker serves on torch matmuls while its kernels build, and says so; once
    they take over, the panel says since when."""
    snap = fixture_snapshot()
    real = replace(snap.workers[0], simulated=False, dtype="bfloat16", kernels="dense-bfloat16",
                   kernels_building=True)
    async with frozen_app.run_test(size=SIZE) as pilot:
        frozen_app.show_snapshot(replace(snap, workers=(real, snap.workers[1])))
        await pilot.pause()
        panel = frozen_app.query(WorkerPanel)[0]
        text = " ".join(str(line.render()) for line in panel.query(Line))
        assert "torch matmuls" in text and "kernels building" in text
        switched = time.mktime((2026, 1, 1, 12, 34, 56, 0, 0, -1))
        frozen_app.show_snapshot(replace(snap, workers=(replace(real, kernels="gguf-avx512", kernels_building=False,
                                                                kernels_since=switched), snap.workers[1])))
        await pilot.pause()
        text = " ".join(str(line.render()) for line in panel.query(Line))
        assert "kernels since 12:34:56" in text and "kernels building" not in text


def busy_snapshot(frame: int, live: int = 200) -> EngineSnapshot:
    """A busy engine `frame` refreshes in: `live` requests decoding, each refresh every one a
    few tokens further, the oldest finished and a new one arrived; worker 0 speculating, its
    acceptance figures moving."""
    base = fixture_snapshot()
    clock = 1000.0 + 0.2 * frame
    requests, timelines = [], {}
    for n in range(1, live + frame + 1):
        done = n <= frame
        out = 4 * (frame - n + live) + 8
        requests.append(RequestView(
            id=f"r{n}", worker=n % 2, state="finished" if done else "decode", prompt_tokens=20, cached_tokens=0,
            output_tokens=out, max_tokens=4000, queue_time=0.01, ttft=0.05, itl_mean=0.05 + 0.001 * frame,
            e2e=0.2 * out, text_tail=f" tok{n}" * out, error=None, burst=None, age=0.2 * (live + frame - n),
            finish_reason="length" if done else None))
        start = 990.0 + 0.01 * n
        timelines[f"r{n}"] = Timeline((("queued", start), ("prefill", start + 0.1), ("decode", start + 0.2)),
                                      ("finished", clock - 0.1) if done else None)
    spec = {"drafts": 40 + frame, "acceptance_rate": 0.5 + 0.01 * frame, "mean_accepted_length": 2.0 + 0.01 * frame,
            "k": 4, "acceptance_per_position": [0.8 - 0.01 * frame, 0.6, 0.4, 0.2]}
    w0 = replace(base.workers[0], spec=spec, spec_modes=("off", "ngram"),
                 spec_history=tuple(0.5 + 0.01 * i for i in range(frame + 1)))
    return replace(base, workers=(w0, base.workers[1]), requests=tuple(requests), timelines=timelines,
                   clock=clock, uptime=125.0 + 0.2 * frame)


@pytest.mark.parametrize("view", ["table", "timeline"])
async def test_a_busy_frame_draws_without_a_layout_pass(frozen_app, view):
    """200 live requests, every one changing at every refresh, requests arriving and finishing:
    the panels keep their sizes, so a refresh repaints what changed and never lays the screen
    out again (a layout pass of the whole screen costs more than drawing the frame)."""
    layouts = []
    async with frozen_app.run_test(size=(200, 60)) as pilot:
        if view == "timeline":
            await pilot.press("g")
        for frame in range(3):                  # the first frames bring the streams on screen
            frozen_app.show_snapshot(busy_snapshot(frame))
            await pilot.pause()
        frozen_app.screen.screen_layout_refresh_signal.subscribe(frozen_app.screen, layouts.append, immediate=True)
        for frame in range(3, 8):
            frozen_app.show_snapshot(busy_snapshot(frame))
            await pilot.pause()
        assert layouts == [], f"{len(layouts)} layout refreshes in 5 refreshes"
        shown = frozen_app.query_one(TimelinePanel if view == "timeline" else RequestsTable)
        assert (shown.lane_count if view == "timeline" else shown.row_count) == 207
        assert frozen_app.query_one(StreamsPanel).shown_ids[-1] == "r207"
        assert "acc [b]57%[/]" in frozen_app.panels["spec"]._shown       # the last frame's figures are shown
