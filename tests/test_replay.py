"""Record and replay: the snapshot stream on disk (engine/facade/snapshot_file.py), the read-only
dashboard that plays it (app/replay.py), and a recording as a Perfetto trace.

The replay snapshot tests play tests/data/replay_burst.rec (written by
tests/fixtures/make_replay_fixture.py from a burst on two simulated workers): a position shows the same
frame whichever way the replay got there.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import signal
import time
from pathlib import Path

import httpx
import pytest

from app.replay import ReplayApp
from app.screens.burst import BurstDialog
from app.widgets import event_log
from engine.config import EngineConfig, SamplingParams, WorkerConfig
from engine.facade.devices import parse_devices
from engine.facade.engine import Engine
from engine.facade.history import History
from engine.facade.snapshot import LogLine
from engine.facade.snapshot_file import (RecordingError, SnapshotRecorder, apply_delta, empty_state,
                                         read_recording, slide, snapshot_state, state_delta, state_snapshot)
from tests.test_app import fixture_snapshot
from tests.trace_checks import check_chrome_trace

FIXTURE = Path(__file__).parent / "data" / "replay_burst.rec"
SNAPSHOTS = Path(__file__).parent / "__snapshots__" / "test_replay"
SIZE = (120, 40)


def same(a, b) -> bool:
    """Snapshots equal up to the 4 decimals a recording keeps of a float."""
    return plain_rounded(a) == plain_rounded(b)


def plain_rounded(value):
    from engine.facade.snapshot_file import plain
    return json.loads(json.dumps(plain(value)))


# --- the format --------------------------------------------------------------------------------
def test_a_snapshot_survives_the_round_trip():
    snap = fixture_snapshot()
    state = snapshot_state(snap, 12.5, "ngram")
    back = empty_state()
    apply_delta(back, json.loads(json.dumps(state_delta(empty_state(), state))))
    again, mode = state_snapshot(back, snap.time - 12.5)
    assert mode == "ngram" and same(again, snap)
    assert again.workers[0].page_states == snap.workers[0].page_states
    assert again.requests[0].params == snap.requests[0].params
    assert isinstance(again.routing[0].candidates, tuple)


def test_slide_finds_what_was_dropped_and_added():
    assert slide("abcdef" * 5, ("abcdef" * 5)[3:] + "xyz") == [3, "xyz"]
    assert slide([1.0, 2.0, 3.0], [2.0, 3.0, 4.0]) == [1, [4.0]]
    assert slide("aaaa", "aaaab") == [0, "b"]
    assert slide("abc", "xyz") is None


class FakeEngine:
    """Hands out the snapshots a test scripts, as Engine.snapshot() would."""

    def __init__(self, snaps):
        self.config = EngineConfig(workers=(WorkerConfig(device="sim:gpu0"), WorkerConfig(device="sim:gpu1")))
        self.snaps = list(snaps)
        self.spec_mode = ""
        self.logged = []

    def snapshot(self):
        return self.snaps.pop(0)

    def log(self, level, text):
        self.logged.append((level, text))


def evolving_snapshots(n: int) -> list:
    """A busy minute, compressed: text tails sliding past 2000 characters, requests and log
    lines coming and going, a page grid changing, a request rewritten in place."""
    base = fixture_snapshot()
    snaps = []
    for i in range(n):
        reqs = []
        for r in base.requests[: 3 + i % 4]:
            text = (r.text_tail + "".join(f" tok{j}" for j in range(i * 40)))[-2000:]
            reqs.append(dataclasses.replace(r, text_tail=text, output_tokens=r.output_tokens + i,
                                            age=r.age + i * 0.2, e2e=(r.e2e or 0) + i * 0.2))
        log = base.log[i % 3:] + tuple(LogLine(base.time + 10 + k, "info", f"line {k}") for k in range(i))
        workers = tuple(dataclasses.replace(w, decode_history=(w.decode_history + tuple(float(k) for k in range(i)))[-60:],
                                            page_states=bytes((k + i) % 4 for k in range(len(w.page_states))))
                        for w in base.workers)
        snaps.append(dataclasses.replace(base, time=base.time + 0.2 * i, requests=tuple(reversed(reqs)) if i == 7
                                         else tuple(reqs), log=log, workers=workers, uptime=base.uptime + 0.2 * i,
                                         clock=base.clock + 0.2 * i, history=history_at(base.clock + 0.2 * i)))
    return snaps


def history_at(clock: float, keep: int = 30) -> dict:
    """Each worker's history charts' points at `clock`: one a second, the oldest dropped
    past `keep`, a KV usage only where the worker reports one."""
    times = tuple(float(t) for t in range(int(clock) - 40, int(clock)))[-keep:]
    return {w: History(times, {"prefill_tps": tuple(100.0 * w + t % 7 for t in times),
                               "decode_tps": tuple(20.0 + w + t % 3 / 4 for t in times),
                               "running": tuple(float(t % 4) for t in times), "waiting": tuple(0.0 for _ in times),
                               "kv_usage": tuple(None if w else (t % 10) / 10 for t in times)})
            for w in (0, 1)}


def test_every_frame_reads_back_as_it_was_recorded(tmp_path):
    snaps = evolving_snapshots(30)
    engine = FakeEngine(snaps)
    path = tmp_path / "r.rec"
    recorder = SnapshotRecorder(engine, path, started=snaps[0].time)
    for _ in snaps:
        recorder.record()
    recorder.close()
    rec = read_recording(path)
    assert len(rec) == 30 and rec.complete and [w.device for w in rec.workers] == ["sim:gpu0", "sim:gpu1"]
    snaps = evolving_snapshots(30)
    order = list(range(30)) + [3, 29, 0, 17, 16, 15]         # in order, then seeking back and forth
    for i in order:
        got, _ = rec.frame(i)
        assert same(got, dataclasses.replace(snaps[i], time=round(snaps[i].time - snaps[0].time, 3) + snaps[0].time)), i
    with gzip.open(path, "rt") as f:
        lines = f.read().splitlines()
    assert any('"~text_tail"' in line for line in lines)     # a sliding tail is written as its change
    assert any('"~times"' in line for line in lines)         # so is a history's new second
    assert rec.frame(29)[0].history[1].values("decode_tps") == snaps[29].history[1].values("decode_tps")
    assert json.loads(lines[-1]) == {"end": 30}


# --- bad files are one line ----------------------------------------------------------------------
def cut(path: Path, keep: float, to: Path) -> Path:
    data = path.read_bytes()
    to.write_bytes(data[: int(len(data) * keep)])
    return to


def test_a_cut_recording_tells_the_command_line_user_to_add_partial(tmp_path, capsys):
    from app.cli import main

    truncated = cut(FIXTURE, 0.6, tmp_path / "cut.rec")
    assert main(["replay", str(truncated), "--trace", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cut short" in err and "add --partial" in err


def test_truncated_and_foreign_files_are_one_line_errors(tmp_path):
    truncated = cut(FIXTURE, 0.6, tmp_path / "cut.rec")
    with pytest.raises(RecordingError, match=r"cut short after \d+ frames .*can be played") as err:
        read_recording(truncated)
    assert "\n" not in str(err.value)
    partial = read_recording(truncated, partial=True)
    assert 0 < len(partial) < len(read_recording(FIXTURE)) and not partial.complete
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    zipped = tmp_path / "other.gz"
    zipped.write_bytes(gzip.compress(b'{"some": "json"}\n'))
    newer = tmp_path / "newer.rec"
    newer.write_bytes(gzip.compress(b'{"format": "tokentop-recording", "version": 99}\n'))
    for path, words in [(text, "not a gzip stream"), (zipped, "no tokentop-recording header"),
                        (newer, "format 99"), (tmp_path / "missing.rec", "no such file")]:
        with pytest.raises(RecordingError, match=words) as err:
            read_recording(path)
        assert "\n" not in str(err.value)


def test_replay_command_errors_are_one_line(tmp_path, capsys):
    from app.cli import main
    code = main(["replay", str(cut(FIXTURE, 0.5, tmp_path / "cut.rec"))])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and "cut short" in err and "Traceback" not in err
    (tmp_path / "x.json").write_text("{}")
    code = main(["replay", str(tmp_path / "x.json")])
    out, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and "not a tokentop recording" in err


def test_record_flag_refuses_an_unwritable_file_before_any_work(tmp_path, capsys):
    from app.cli import main
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code = main(["serve", "--record", str(blocker / "x.rec"), "--port", "0", "--device", "sim:a:prefill=1,decode=1",
                 "--model", str(FIXTURE)])
    out, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and "--record" in err and "Traceback" not in err


# --- a recording as a trace --------------------------------------------------------------------
def test_replay_trace_turns_the_recording_into_a_perfetto_trace(tmp_path, capsys):
    from app.cli import main
    out = tmp_path / "replay.json"
    assert main(["replay", str(FIXTURE), "--trace", str(out)]) == 0
    assert "written to" in capsys.readouterr().err
    document = json.loads(out.read_text())
    assert check_chrome_trace(document) == []
    events = document["traceEvents"]
    rec = read_recording(FIXTURE)
    last, _ = rec.frame(len(rec) - 1)
    for r in last.requests:
        phases = [e["name"] for e in events if e["ph"] == "X" and e["args"]["request"] == r.id]
        assert phases[0] == "queued" and "decode" in phases
        assert phases[-1] == ("finished" if r.state == "finished" else "decode")
    processes = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {"engine", "worker 0 (sim:gpu0)", "worker 1 (sim:gpu1)"}
    kv = [e["args"]["used"] for e in events if e["ph"] == "C" and e["name"] == "kv pages"]
    assert len(kv) == 2 * len(rec) and len(set(kv)) > 2
    assert {e["args"]["request"] for e in events if e["name"] == "route"} == {r.id for r in last.requests}


# --- size ----------------------------------------------------------------------------------------
def test_a_16_request_burst_records_well_under_a_megabyte_a_minute(tiny_model_path, tmp_path):
    """The first seconds of a burst are its costliest (every request arrives with its prompt):
    extrapolated from them, a minute stays under 1 MB."""
    from app.bursts import load_burst
    root = Path(__file__).parent.parent / "sample_prompts"
    items = load_burst(root / "mixed.jsonl") + load_burst(root / "code_refactor.jsonl")
    base = WorkerConfig(model=str(tiny_model_path("qwen2", context_length=8192)), kv_cache_memory=8 * 2**20)
    devices = ["sim:gpu0:prefill=4000,decode=300", "sim:gpu1:prefill=2500,decode=200"]
    path = tmp_path / "burst.rec"
    with Engine(EngineConfig(workers=parse_devices(devices, base), worker_mode="thread")).start() as engine:
        recorder = SnapshotRecorder(engine, path).start()
        for item in items:
            engine.submit(item.prompt, messages=item.messages, params=item.params)
        time.sleep(5.0)
        recorder.close()
    rec = read_recording(path)
    last, _ = rec.frame(len(rec) - 1)
    assert len(items) == 16 and len(last.requests) == 16
    per_minute = path.stat().st_size * 60 / rec.duration
    assert per_minute <= 1_000_000, per_minute


# --- serve --record ----------------------------------------------------------------------------
def test_serve_record_writes_a_complete_recording(tiny_model_path, tmp_path):
    from tests.serve_util import ServeProcess
    path = tmp_path / "serve.rec"
    server = ServeProcess(["--model", str(tiny_model_path("qwen2", context_length=2048)), "--worker-mode", "thread",
                           "--device", "sim:gpu0:prefill=20000,decode=2000", "--record", str(path)], timeout=60)
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "recorded", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200
        time.sleep(0.6)
    finally:
        server.proc.send_signal(signal.SIGTERM)
        server.stop()
    rec = read_recording(path)
    assert rec.complete and rec.header["command"][:2] == ["tokentop", "serve"]
    last, _ = rec.frame(len(rec) - 1)
    assert [r.state for r in last.requests] == ["finished"] and last.requests[0].output_tokens == 4


# --- the replay dashboard ----------------------------------------------------------------------
@pytest.fixture
def frozen_clock(monkeypatch):
    monkeypatch.setattr(event_log, "format_clock", lambda t: time.strftime("%H:%M:%S", time.gmtime(t)))


def replay_app(tmp_path, **kw) -> ReplayApp:
    return ReplayApp(read_recording(FIXTURE), settings_path=tmp_path / "settings.json", **kw)


@pytest.mark.parametrize("way", ["opened-there", "seeked-there"])
def test_snapshot_replay_at_5s(way, tmp_path, frozen_clock, snap_compare):
    """5 s into the fixture: opened at 5 s, or opened at 0 and moved on with →."""
    if way == "opened-there":
        app = replay_app(tmp_path, position=5.0, paused=True)
        assert snap_compare(app, terminal_size=SIZE)
    else:
        app = replay_app(tmp_path, position=0.0, paused=True)
        assert snap_compare(app, terminal_size=SIZE, press=["right"])


def test_the_same_position_draws_the_same_picture():
    """Both ways to 5 s drew identical screens (after the snapshot tests above have run or
    been updated)."""
    files = sorted(SNAPSHOTS.glob("test_snapshot_replay_at_5s*.svg"))
    assert len(files) == 2
    assert files[0].read_text() == files[1].read_text()


async def test_replay_shows_the_recorded_history_charts_the_same_at_a_position(tmp_path):
    """`h` in a replay draws the recorded history: at one position the same points whichever
    way the replay got there, and the points of that frame, not of the live engine's clock."""
    snaps = evolving_snapshots(30)
    path = tmp_path / "h.rec"
    recorder = SnapshotRecorder(FakeEngine(snaps), path, started=snaps[0].time)
    for _ in snaps:
        recorder.record()
    recorder.close()
    rec = read_recording(path)
    at = rec.times[20]
    drawn = []
    for start, keys in ((at, []), (0.0, ["full_stop"] * 20)):
        app = ReplayApp(rec, settings_path=tmp_path / "settings.json", position=start, paused=True)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("h", *keys)
            await pilot.pause(0.2)
            assert app.shown_index == 20
            drawn.append(app.panels["charts"].plotted)
    assert drawn[0] == drawn[1]
    clock = snaps[20].clock
    decode = dict((label, (xs, ys)) for label, xs, ys in drawn[0]["decode"])
    assert len(decode) == 2
    xs, ys = next(iter(decode.values()))
    want = snaps[20].history[0]
    assert xs == [t - round(clock, 3) for t in want.times]
    assert ys == list(want.values("decode_tps"))


async def test_the_replay_timeline_does_not_offer_the_key_the_replay_takes(tmp_path):
    """space pauses the recording, so the timeline (g) neither says it pauses it nor does so;
    + - still zoom it while it has the focus."""
    app = replay_app(tmp_path, paused=True)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("g")
        title = str(app.boxes["requests"].border_title)
        assert title == "timeline · 30 s (+ -, g: table)", title
        await pilot.press("space", "plus")
        assert not app.paused and not app.panels["timeline"].paused and app.panels["timeline"].span == 10.0
        assert str(app.boxes["requests"].border_title) == "timeline · 10 s (+ -, g: table)"


async def test_replay_keys_play_pause_seek_step_and_speed(tmp_path):
    app = replay_app(tmp_path)
    rec = app.recording
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.4)
        assert not app.paused and app.position > 0.1             # it plays on its own
        await pilot.press("space")
        assert app.paused
        at = app.position
        await pilot.pause(0.3)
        assert app.position == at
        await pilot.press("right")
        assert app.position == pytest.approx(min(at + 5, rec.duration))
        await pilot.press("left", "left")
        assert app.position == 0.0 and app.shown_index == 0
        await pilot.press("full_stop", "full_stop")
        assert app.shown_index == 2 and app.position == rec.times[2]
        shown = app.last_snapshot
        await pilot.press("right", "left")                       # away and back to the same position
        assert app.position == pytest.approx(rec.times[2]) and app.last_snapshot is not shown
        assert app.last_snapshot == shown                        # the same frame again
        await pilot.press("plus", "plus")
        assert app.speed == 4.0
        await pilot.press("minus")
        assert app.speed == 2.0 and "2×" in str(app._bar.render())
        # the engine's keys do nothing on a recording; looking still works
        await pilot.press("b")
        assert not isinstance(app.screen, BurstDialog)
        assert app.check_action("burst", ()) is False and app.check_action("cycle_router", ()) is False
        assert app.check_action("zoom", ()) is True
        await pilot.press("space")
        await pilot.pause(rec.duration / 2 + 0.5)
        assert app.paused and app.position == rec.duration      # it stops at the end
        await pilot.press("space")
        assert not app.paused and app.position < rec.duration / 2   # and plays again from the start


def test_recorded_burst_replays_with_its_requests(tiny_model_path, tmp_path):
    """From a live engine to the replay: the requests submitted are the ones replayed."""
    cfg = EngineConfig(workers=parse_devices(["sim:gpu0:prefill=20000,decode=1000"],
                                             WorkerConfig(model=str(tiny_model_path("qwen2")))), worker_mode="thread")
    path = tmp_path / "live.rec"
    with Engine(cfg).start(timeout=60) as engine:
        recorder = SnapshotRecorder(engine, path).start()
        ids = [engine.submit(f"request {i}", params=SamplingParams(max_tokens=5)).id for i in range(3)]
        time.sleep(0.8)
        recorder.close()
    rec = read_recording(path)
    last, _ = rec.frame(len(rec) - 1)
    assert [r.id for r in last.requests] == ids and all(r.state == "finished" for r in last.requests)
