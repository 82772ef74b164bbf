"""Text from outside never reaches the terminal as a control sequence (engine/outside.py).

Every string a snapshot, a recording, a watched server, a burst file or a status server can
carry is filled with escape sequences; the dashboard (through Textual's pilot, every panel and
screen), replay, watch, status and compare are then asked to show it. No ESC, BEL or C1 byte
may reach a rendered segment or stdout / stderr: they are shown in caret notation instead.
"""
from __future__ import annotations

import dataclasses
import enum
import io
import json
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from textual.content import Content

from app.cli import build_dashboard_parser, start_dashboard_http
from app.main import TokentopApp
from app.printing import json_text, stream_text
from app.replay import ReplayApp
from app.screens.burst import BurstDialog
from app.screens.compare import CompareResult
from app.watch import WatchApp, as_text
from app.widgets.fmt import outside_markup
from tests.test_watch import _fixture_server
from engine.config import EngineConfig, WorkerConfig
from engine.facade.alerts import Alert
from engine.facade.devices import parse_devices
from engine.facade.history import History
from engine.facade.snapshot import EngineSnapshot, LogLine
from engine.facade.recording_read import read_recording
from engine.facade.snapshot_file import SnapshotRecorder
from engine.facade.timeline import Timeline
from engine.outside import visible
from engine.watch.watcher import Watcher
from tests.fixtures.tiny_gguf import write_tiny_model
from tests.test_app import fixture_snapshot

HOSTILE = "\x1b]0;x\x07\x1b[2J\x9b2J"
SHOWN = "^[]0;x^G^[[2J<9b>2J"          # what the terminal gets instead
ESCAPES = re.compile(r"[\x1b\x07\x80-\x9f]")
ROOT = Path(__file__).resolve().parent.parent
# fields whose value picks a code path (a state, a level): poisoned in a second pass only, so
# the first one shows every field the way a healthy picture does
CHOICES = {"state", "level", "finish_reason", "policy", "router_policy", "trace_detail", "prompt_source",
           "kind", "mode", "window"}


def poison(value, keep: frozenset[str] = frozenset()):
    """`value` with HOSTILE added to every string in it (dataclass fields, tuples, dict values),
    but for the dataclass fields named in `keep` and enum members (a RequestView's state can
    only be one of RequestState's)."""
    if isinstance(value, enum.Enum):
        return value
    if isinstance(value, str):
        return value + HOSTILE
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: poison(getattr(value, f.name), keep) for f in dataclasses.fields(value)
                   if f.name not in keep and f.init}
        return replace(value, **changes)
    if isinstance(value, tuple):
        return tuple(poison(v, keep) for v in value)
    if isinstance(value, list):
        return [poison(v, keep) for v in value]
    if isinstance(value, dict):
        return {k: poison(v, keep) for k, v in value.items()}
    return value


def rich_snapshot() -> EngineSnapshot:
    """The dashboard tests' busy moment, with what it leaves out: speculation, timelines,
    history, an alert."""
    snap = fixture_snapshot()
    spec = {"mode": "ngram", "drafts": 40, "acceptance_rate": 0.5, "mean_accepted_length": 2.1, "k": 3,
            "acceptance_per_position": [0.8, 0.4]}
    workers = tuple(replace(w, simulated=False, spec=spec, spec_modes=("off", "ngram"), dtype="bfloat16",
                            kernels="gguf-avx2", message="measuring" if i else "") for i, w in enumerate(snap.workers))
    requests = tuple(replace(r, spec=spec, drafted_spans=((0, 3),), notice="max_tokens lowered") for r in snap.requests)
    phases = (("queued", snap.clock - 3), ("decode", snap.clock - 2))
    timelines = {r.id: Timeline(phases, ticks=(("spec", snap.clock - 1),)) for r in requests}
    history = {w.index: History((1.0, 2.0, 3.0), {"decode_tps": (1.0, 2.0, 3.0), "kv_usage": (0.1, 0.2, 0.3)})
               for w in workers}
    alerts = (Alert("stall", 0, "sim:gpu0", snap.time, "no tokens for 5 s"),)
    return replace(snap, workers=workers, requests=requests, timelines=timelines, history=history, alerts=alerts)


def hostile_snapshot(keep: frozenset[str]) -> EngineSnapshot:
    snap = poison(rich_snapshot(), keep)
    # timelines are found by request id: key them by the poisoned ids
    return replace(snap, timelines={r.id: t for r, t in zip(snap.requests, snap.timelines.values())})


def screen_text(app) -> str:
    """Every segment of every screen on the stack, as it is written to the terminal."""
    return "".join(seg.text for screen in app.screen_stack
                   for strip in screen._compositor.render_strips() for seg in strip)


def assert_clean(text: str, where: str) -> None:
    bad = ESCAPES.search(text)
    assert bad is None, f"{where}: a raw control byte is shown: {text[max(0, bad.start() - 60):bad.end() + 60]!r}"


async def assert_screen_clean(app, pilot, where: str) -> str:
    await pilot.pause()
    text = screen_text(app)
    assert_clean(text, where)
    return text


def sim_config(model: Path, devices=("sim:gpu0:prefill=20000,decode=150", "sim:gpu1:prefill=20000,decode=150")):
    return EngineConfig(workers=parse_devices(list(devices), WorkerConfig(model=str(model), kv_cache_memory=4 * 2**20)),
                        worker_mode="thread")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny.gguf", "qwen2", context_length=8192)


async def wait_for(pilot, predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await pilot.pause(0.05)


# --- the dashboard ----------------------------------------------------------------------------
async def test_a_chat_request_with_escapes_is_shown_in_caret_notation_when_opened(tiny_model, tmp_path):
    """The worst probe: an HTTP client's chat content retitles and wipes the operator's terminal
    when the operator opens the request (Enter)."""
    app = TokentopApp(sim_config(tiny_model, ["sim:gpu0:prefill=20000,decode=100"]),
                      settings_path=tmp_path / "s.json")
    http = start_dashboard_http(app, build_dashboard_parser().parse_args(["--serve", "127.0.0.1:0"]))
    try:
        async with app.run_test(size=(120, 40), notifications=True) as pilot:
            await wait_for(pilot, lambda: app.engine.ready, "the engine")
            async with httpx.AsyncClient(base_url=http.url, timeout=30) as c:
                r = await c.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": f"{HOSTILE} hello"}], "max_tokens": 8})
                assert r.status_code == 200, r.text
            await wait_for(pilot, lambda: app.last_snapshot and any(
                q.state == "finished" for q in app.last_snapshot.requests), "the request to finish")
            await assert_screen_clean(app, pilot, "the dashboard")
            await pilot.press("enter")
            await pilot.pause(0.3)
            shown = await assert_screen_clean(app, pilot, "the request's detail")
            assert SHOWN in shown
    finally:
        http.stop()


@pytest.mark.parametrize("keep", [CHOICES, frozenset()], ids=["values", "everything"])
async def test_every_string_of_a_snapshot_is_shown_in_caret_notation(tiny_model, tmp_path, keep):
    """Every panel, both request views (table, timeline), both bottom views (streams, charts), the
    compact worker lines and the detail screen, fed a snapshot whose every string holds escapes."""
    app = TokentopApp(sim_config(tiny_model), settings_path=tmp_path / "s.json", live=False)
    snap = hostile_snapshot(keep)
    async with app.run_test(size=(160, 50), notifications=True) as pilot:
        app.show_snapshot(snap)
        shown = await assert_screen_clean(app, pilot, "the main screen")
        if keep:
            assert SHOWN in shown
        for key in ("g", "h"):                     # the timeline, then the history charts
            await pilot.press(key)
            app.show_snapshot(snap)
            await assert_screen_clean(app, pilot, f"after {key}")
        await pilot.resize_terminal(70, 40)        # the workers one line each
        app.show_snapshot(snap)
        await assert_screen_clean(app, pilot, "the narrow screen")
        await pilot.press("e")                     # one worker in full beside the lines
        app.show_snapshot(snap)
        await assert_screen_clean(app, pilot, "an expanded worker")
        await pilot.resize_terminal(160, 50)
        await pilot.press("g", "h", "enter")       # back to the table and the streams; the detail
        await pilot.pause(0.3)
        await assert_screen_clean(app, pilot, "the request's detail")


async def test_notifications_show_outside_text_in_caret_notation(tiny_model, tmp_path):
    app = TokentopApp(sim_config(tiny_model), settings_path=tmp_path / "s.json", live=False)
    async with app.run_test(size=(120, 40), notifications=True) as pilot:
        app.notify(f"aborting r1{HOSTILE} [b]not markup[/b", title=f"t{HOSTILE}")
        shown = await assert_screen_clean(app, pilot, "a notification")
        assert SHOWN in shown and "[b]not markup[/b" in shown


# --- replay -----------------------------------------------------------------------------------
class RecordedEngine:
    """What SnapshotRecorder reads of an engine: its config and its snapshots."""

    def __init__(self, workers: tuple[WorkerConfig, ...], snaps: list[EngineSnapshot]) -> None:
        self.config = EngineConfig(workers=workers, worker_mode="thread")
        self.snaps = list(snaps)
        self.spec_mode = "ngram" + HOSTILE

    def snapshot(self) -> EngineSnapshot:
        return self.snaps.pop(0)


def hostile_recording(tmp_path: Path, keep: frozenset[str]) -> Path:
    """A recording, written by the recorder itself, whose every string holds escapes: the
    workers of its header, each frame's fields, its file name."""
    workers = tuple(WorkerConfig(device=f"sim:gpu{i}", name=f"gpu{i}{HOSTILE}", model=f"tiny{HOSTILE}.gguf")
                    for i in range(2))
    snap = hostile_snapshot(keep)
    snaps = [replace(snap, time=snap.time + i, clock=snap.clock + i,
                     log=snap.log + (LogLine(snap.time + i, "info", f"frame {i}{HOSTILE}"),)) for i in range(3)]
    path = tmp_path / f"r{HOSTILE}.rec"
    recorder = SnapshotRecorder(RecordedEngine(workers, snaps), path, started=snaps[0].time)
    for _ in snaps:
        recorder.record()
    recorder.close()
    return path


@pytest.mark.parametrize("keep", [CHOICES, frozenset()], ids=["values", "everything"])
async def test_a_recording_with_escapes_replays_in_caret_notation(tmp_path, keep):
    rec = read_recording(hostile_recording(tmp_path, keep))
    app = ReplayApp(rec, settings_path=tmp_path / "s.json", paused=True)
    async with app.run_test(size=(160, 50), notifications=True) as pilot:
        shown = await assert_screen_clean(app, pilot, "the replay")
        assert SHOWN in shown
        for keys in (["full_stop"], ["g"], ["h"], ["g", "h", "enter"]):
            await pilot.press(*keys)
            await pilot.pause(0.2)
            await assert_screen_clean(app, pilot, f"the replay after {keys}")


# --- watch and status against a hostile server -------------------------------------------------
def hostile_metrics(kind: str) -> str:
    """A Prometheus page whose label values hold escapes (the exposition format escapes only
    backslash, quote and newline)."""
    name = "tokentop:worker_info" if kind == "tokentop" else "vllm:num_requests_running"
    return (f'# TYPE {name} gauge\n{name}{{model_name="m{HOSTILE}",worker="w{HOSTILE}"}} 1\n'
            f'# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{model_name="m{HOSTILE}"}} 2\n')


def hostile_server(routes: dict[str, tuple[int, str]]):
    """127.0.0.1 HTTP server answering GET path -> (status, body); 404 elsewhere."""
    return _fixture_server({path: (lambda answer=answer: answer) for path, answer in routes.items()})


def tokentop_routes() -> dict[str, tuple[int, str]]:
    from engine.serve.snapshot_json import snapshot_json

    snap = json.dumps(snapshot_json(hostile_snapshot(CHOICES)), ensure_ascii=False)
    return {"/metrics": (200, hostile_metrics("tokentop")), "/snapshot": (200, snap), "/health": (200, "ok")}


@pytest.fixture(scope="module")
def servers():
    """A tokentop server whose /snapshot and metric labels hold escapes, and a vLLM-like one."""
    other = {"/metrics": (200, hostile_metrics("vllm")), "/health": (200, "ok")}
    with hostile_server(tokentop_routes()) as a, hostile_server(other) as b:
        yield [a, b]


async def test_watch_shows_a_servers_escapes_in_caret_notation(servers):
    watcher = Watcher(servers)
    try:
        statuses = watcher.poll()
        text = as_text(statuses)                   # what --once prints
        assert_clean(text, "watch --once")
        assert SHOWN in text
        app = WatchApp(watcher, interval=0.2)
        async with app.run_test(size=(160, 50), notifications=True) as pilot:
            await wait_for(pilot, lambda: all("(looking)" not in str(p.render()) for p in app.panels.values()),
                           "both servers' groups")
            shown = await assert_screen_clean(app, pilot, "watch")
            assert SHOWN in shown
    finally:
        watcher.close()


def run_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(Path.home())}
    return subprocess.run([sys.executable, "-m", "app.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_watch_once_prints_escapes_in_caret_notation(servers):
    done = run_cli("watch", *servers, "--once", "--interval", "0.2")
    assert_clean(done.stdout, "watch --once stdout")
    assert_clean(done.stderr, "watch --once stderr")
    assert SHOWN in done.stdout
    done = run_cli("watch", *servers, "--once", "--json", "--interval", "0.2")
    assert_clean(done.stdout, "watch --once --json")
    assert json.loads(done.stdout)


def test_status_prints_a_servers_escapes_in_caret_notation(servers):
    done = run_cli("status", servers[0])
    assert done.returncode == 0, done.stderr
    assert_clean(done.stdout, "status")
    assert SHOWN in done.stdout
    done = run_cli("status", servers[0], "--json")
    assert_clean(done.stdout, "status --json")
    assert json.loads(done.stdout)["alerts"][0]["message"].endswith(HOSTILE)     # the data itself is kept


def test_status_echoes_an_error_body_in_caret_notation():
    with hostile_server({"/snapshot": (500, f"boom{HOSTILE}")}) as url:
        done = run_cli("status", url)
    assert done.returncode != 0
    assert_clean(done.stderr, "status's error")
    assert SHOWN in done.stderr and len(done.stderr.splitlines()) == 1


# --- compare ----------------------------------------------------------------------------------
def test_compare_prints_a_burst_files_escapes_in_caret_notation(tiny_model, tmp_path):
    burst = tmp_path / f"b{HOSTILE}.jsonl"
    burst.write_text("".join(json.dumps({"id": f"q{i}{HOSTILE}", "prompt": f"hello {i}{HOSTILE}", "max_tokens": 4})
                             + "\n" for i in range(2)))
    common = ("--a", "single-flight=off", "--b", "single-flight=after-prefill", "--model", str(tiny_model),
              "--device", "sim:a:prefill=20000,decode=400", "--interval-ms", "0", "--out", str(tmp_path / "r.json"))
    done = run_cli("compare", str(burst), *common)
    assert done.returncode == 0, done.stderr
    assert_clean(done.stdout, "compare's table")
    assert_clean(done.stderr, "compare's progress")
    assert SHOWN in done.stdout
    done = run_cli("compare", str(burst), *common, "--json")
    assert_clean(done.stdout, "compare --json")
    assert json.loads(done.stdout)["a"]["requests"][0]["id"] == f"q0{HOSTILE}"


async def test_dialogs_show_file_names_and_reports_in_caret_notation(tiny_model, tmp_path):
    app = TokentopApp(sim_config(tiny_model), settings_path=tmp_path / "s.json", live=False)
    async with app.run_test(size=(120, 40), notifications=True) as pilot:
        app.push_screen(CompareResult(f"id q1{HOSTILE} [b]\\", f"/tmp/r{HOSTILE}.json"))
        shown = await assert_screen_clean(app, pilot, "the compare result")
        assert SHOWN in shown and "[b]\\" in shown
        app.pop_screen()
        app.push_screen(BurstDialog([Path(f"/tmp/b{HOSTILE}.jsonl")]))
        shown = await assert_screen_clean(app, pilot, "the burst dialog")
        assert f"b{SHOWN}.jsonl" in shown


def test_json_text_escapes_what_json_dumps_keeps_raw():
    value = {"id": f"q{HOSTILE}\ud800", "text": "naïve"}
    text = json_text(value)
    assert_clean(text, "json_text")
    assert json.loads(text) == value and "naïve" in text


def test_generate_shows_a_models_escapes_only_on_a_terminal(monkeypatch):
    """Piped, a model's output is data and stays exact; on a terminal it is shown."""
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True
    monkeypatch.setattr(sys, "stdout", Terminal())
    assert stream_text(f"a{HOSTILE}\n") == f"a{SHOWN}\n"
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert stream_text(HOSTILE) == HOSTILE


def test_accepted_draft_text_is_coloured_where_it_is_drawn():
    """A control character is drawn wider (^[): the accepted-draft spans after it move with it."""
    from app.widgets.streams import drafted_ranges, stream_body, stream_label, stream_lines

    tail = f"\x1bab{HOSTILE}cd"
    r = replace(fixture_snapshot().requests[3], text_tail=tail, drafted_spans=((1, 3), (len(tail) - 2, len(tail))))
    label = stream_label(r)
    drawn = "\n".join(stream_lines(label, stream_body(r), 200))
    assert_clean(drawn, "a stream")
    assert [drawn[a:b] for a, b in drafted_ranges(r, label, 200)] == ["ab", "cd"]


@pytest.mark.parametrize("text", ["a[2J", "ends in a backslash\\", "[b]y[/b]", "\\[b]", "[$accent]", HOSTILE])
def test_outside_text_placed_in_markup_stays_text(text):
    """Every bracket is text (textual's escape leaves '[2J', which swallows the closing tag), and
    a final backslash does not escape the tag after it."""
    content = Content.from_markup(f"[b]{outside_markup(text)}[/b] end")
    assert content.plain.replace("\u200b", "") == visible(text) + " end"
