"""What the dashboard shows over time: the latency panel and the header's latency figures
(app/widgets/latency.py), the alert badge, every worker on screen however many there are
(app/widgets/workers.py), the request timeline (app/widgets/timeline.py), the history charts
(app/widgets/charts.py); live on simulated workers and on hand-built snapshots."""
from __future__ import annotations

import math
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
from textual.content import Content

from app.main import TokentopApp
from app.widgets import event_log
from app.screens.detail import RequestDetail
from app.widgets.charts import Chart, HistoryCharts, chart_series, fit_columns, time_ticks
from app.widgets.requests import RequestsTable
from app.widgets.streams import StreamsPanel
from app.widgets.timeline import TimelinePanel, axis_text, lane_cells
from app.widgets.worker import WorkerPanel
from app.widgets.worker_line import WorkerLine
from app.widgets.workers import WorkersRow
from engine.config import EngineConfig, WorkerConfig
from engine.facade.devices import parse_devices
from engine.facade.snapshot import EngineSnapshot
from engine.facade.history import History, HistoryStore
from engine.facade.timeline import Timeline

from app.widgets.fmt import fmt_seconds
from app.widgets.latency import MIN_SPAN, hist_bars, latency_markup, metric_line
from engine.facade.latency import HIST_BINS, HIST_EDGES, LatencyView, Summary
from engine.facade.alerts import Alert
from tests.test_app import (fire_burst, fixture_snapshot, frozen_app, make_app, tiny_model,  # noqa: F401 (fixtures)
                            wait_for, wait_ready)


def plain(markup: str) -> str:
    return Content.from_markup(markup).plain


def test_histogram_spans_its_samples_and_merges_bins_to_fit():
    hist = [0] * HIST_BINS
    hist[30], hist[31], hist[45] = 4, 8, 2
    bars, lo, hi = hist_bars(tuple(hist), 40)
    assert (lo, hi) == (30, 45) and len(bars) == 16          # one column per bin
    assert bars[1] == "█" and bars[0] == "▄" and bars[-1] == "▂" and set(bars[2:-1]) == {" "}
    merged, lo2, hi2 = hist_bars(tuple(hist), 4)
    assert len(merged) == 4 and (lo2, hi2) == (30, 45) and merged[0] == "█"   # bins of 4: 12, 0, 0, 2
    one = [0] * HIST_BINS
    one[20] = 1
    bars, lo, hi = hist_bars(tuple(one), 40)
    assert len(bars) == MIN_SPAN and bars.count("█") == 1     # one decade at least
    assert hist_bars((0,) * HIST_BINS, 40) == ("", 0, 0)


def test_table_drops_p95_then_the_histogram_when_narrow():
    s = Summary(12, 0.031, 0.047, 0.052, tuple([0] * 30 + [3, 9] + [0] * (HIST_BINS - 32)))
    wide = plain(metric_line("ttft", s, 70))
    assert wide.split()[:5] == ["TTFT", "31ms", "47ms", "52ms", "12"]
    _, lo, hi = hist_bars(s.hist, 70)
    assert "▃█" in wide and f"{fmt_seconds(HIST_EDGES[lo])}–{fmt_seconds(HIST_EDGES[hi + 1])}" in wide
    narrow = plain(metric_line("ttft", s, 23))
    assert narrow.split() == ["TTFT", "31ms", "52ms", "12"] and len(narrow) <= 23
    view = LatencyView("10s", 10.0, {"ttft": s}, {0: {"ttft": s}})
    text = plain(latency_markup(view, {0: "sim:gpu0", 1: "sim:gpu1"}, 23))
    assert all(len(line) <= 23 for line in text.splitlines())
    assert "gpu0   TTFT 52ms" in text and "gpu1   —" in text
    assert "no requests yet" in plain(latency_markup(None, {}, 40))


async def test_panel_and_header_show_the_engines_figures_and_w_cycles_the_window(tiny_model, tmp_path):
    app = make_app(tiny_model, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_ready(pilot, app)
        await fire_burst(pilot, app, count="6", interval="0", max_tokens="8")
        await wait_for(pilot, lambda: app.last_snapshot.latency["10s"].summary("e2e").count == 6,
                       "six finished requests in the 10 s window")
        await pilot.pause(0.3)
        snap = app.last_snapshot
        ttft = snap.latency["10s"].summary("ttft")
        text = plain(app.panels["latency"]._shown)
        row = next(line for line in text.splitlines() if line.startswith("TTFT"))
        assert row.split()[:3] == ["TTFT", fmt_seconds(ttft.p50), fmt_seconds(ttft.p99)]
        assert row.split()[3] == str(ttft.count)
        assert next(line for line in text.splitlines() if line.startswith("e2e")).split()[3] == "6"
        assert f"TTFT p50 {fmt_seconds(ttft.p50)} p99 {fmt_seconds(ttft.p99)}" in str(app._status.render())
        panel = app.query_one("#latency-panel")
        assert str(panel.border_title).startswith("latency · 10s")
        for window in ("60s", "session", "10s"):
            await pilot.press("w")
            assert app.latency_window == window and str(panel.border_title).startswith(f"latency · {window}")
        await pilot.press("w")
        await pilot.pause(0.3)
        assert "6" in next(line for line in plain(app.panels["latency"]._shown).splitlines() if line.startswith("e2e"))


async def test_the_header_badge_names_the_alert_or_counts_them(frozen_app):
    stall = Alert("stall", 1, "sim:gpu1", 0.0, "worker 1 (sim:gpu1) stalled: ...")
    dead = Alert("worker-dead", 0, "sim:gpu0", 0.0, "worker 0 (sim:gpu0) died: ...")
    async with frozen_app.run_test(size=(80, 24)) as pilot:
        frozen_app.show_snapshot(fixture_snapshot())
        await pilot.pause()
        assert "⚠" not in str(frozen_app._status.render())
        frozen_app.show_snapshot(replace(fixture_snapshot(), alerts=(stall,)))
        await pilot.pause()
        header = str(frozen_app._status.render())
        assert header.startswith(" tokentop ·  ⚠ stall gpu1  · 2/2 ready") and len(header) <= 80
        frozen_app.show_snapshot(replace(fixture_snapshot(), alerts=(stall, dead)))
        await pilot.pause()
        assert "⚠ 2 alerts" in str(frozen_app._status.render())


# --- every worker on screen ------------------------------------------------------------------
def many_workers(n: int, model) -> tuple:
    """fixture_snapshot's busy moment with n workers (alternately like its two), and their config."""
    base = fixture_snapshot()
    workers = tuple(replace(base.workers[i % 2], index=i, name=f"sim:gpu{i}", device=f"sim:gpu{i}",
                            cpu_percent=90.0 + i, decode_tps=398.0 - 30 * i) for i in range(n))
    config = EngineConfig(workers=parse_devices([f"sim:gpu{i}" for i in range(n)], WorkerConfig(model=str(model))),
                          worker_mode="thread")
    return replace(base, workers=workers), config


def frozen_many(n: int, model, tmp_path, monkeypatch) -> tuple[TokentopApp, EngineSnapshot]:
    monkeypatch.setattr(event_log, "format_clock", lambda t: time.strftime("%H:%M:%S", time.gmtime(t)))
    snap, config = many_workers(n, model)
    return TokentopApp(config, settings_path=tmp_path / "settings.json", live=False), snap


def shown(snap):
    async def show(pilot):
        pilot.app.show_snapshot(snap)
        await pilot.pause()
    return show


def press_and_show(snap, *keys):
    async def run(pilot):
        pilot.app.show_snapshot(snap)
        await pilot.pause()
        for key in keys:
            await pilot.press(key)
        await pilot.pause()
    return run


def test_snapshot_three_workers_80x24_are_one_line_each(tiny_model, tmp_path, monkeypatch, snap_compare):
    app, snap = frozen_many(3, tiny_model, tmp_path, monkeypatch)
    assert snap_compare(app, terminal_size=(80, 24), run_before=shown(snap))


def test_snapshot_six_workers_80x24_one_expanded(tiny_model, tmp_path, monkeypatch, snap_compare):
    app, snap = frozen_many(6, tiny_model, tmp_path, monkeypatch)
    assert snap_compare(app, terminal_size=(80, 24), run_before=press_and_show(snap, "e", "e"))


def test_snapshot_six_workers_200x50(tiny_model, tmp_path, monkeypatch, snap_compare):
    app, snap = frozen_many(6, tiny_model, tmp_path, monkeypatch)
    assert snap_compare(app, terminal_size=(200, 50), run_before=shown(snap))


@pytest.mark.parametrize("n, size", [(3, (80, 24)), (6, (80, 24)), (6, (200, 50)), (12, (80, 24))])
async def test_every_worker_is_on_screen_without_scrolling(tiny_model, tmp_path, monkeypatch, n, size):
    app, snap = frozen_many(n, tiny_model, tmp_path, monkeypatch)
    async with app.run_test(size=size) as pilot:
        app.show_snapshot(snap)
        await pilot.pause()
        row = app.query_one(WorkersRow)
        assert row.compact
        lines = app.query(WorkerLine)
        screen = app.screen.region
        for line in lines:
            region = line.region
            assert region.width > 20 and screen.contains_region(region), (line.index, region)
            text = str(line.render())
            assert text.startswith(f"w{line.index} gpu{line.index}") and "run " in text and "wait " in text
        assert len({(line.region.x, line.region.y) for line in lines}) == n      # none on top of another
        assert not any(p.display for p in app.query(WorkerPanel))
        # e shows each in full in turn, beside the lines, then none; a click picks one
        for index in [*range(n), None]:
            await pilot.press("e")
            assert row.expanded == index
            assert [p.index for p in app.query(WorkerPanel) if p.display] == ([] if index is None else [index])
            assert all(line.region.height == 1 and screen.contains_region(line.region) for line in lines)
        await pilot.click(f"#worker-line-{n - 1}")
        assert row.expanded == n - 1
        await pilot.click(f"#worker-line-{n - 1}")
        assert row.expanded is None


async def test_workers_that_fit_keep_their_panels(frozen_app):
    async with frozen_app.run_test(size=(80, 24)) as pilot:
        frozen_app.show_snapshot(fixture_snapshot(dead=True))
        await pilot.pause()
        row = frozen_app.query_one(WorkersRow)
        assert not row.compact and all(p.display for p in frozen_app.query(WorkerPanel))
        await pilot.press("e")
        assert row.expanded is None and any("already shown in full" in n.message
                                            for n in frozen_app._notifications)
        # the dead worker's line (shown once the panels no longer fit) says so too
        line = frozen_app.query(WorkerLine)[1]
        assert "● dead" in str(line.render()) and "exit code -9" in str(line.render())


# --- the request timeline --------------------------------------------------------------------
def fixture_timelines(clock: float = 1000.0) -> dict:
    """Lanes for fixture_snapshot's six requests: every phase, chunk and verify-round ticks, every end."""
    c = clock
    return {
        "r1": Timeline((("queued", c - 9.0), ("prefill", c - 8.9), ("decode", c - 8.5)), ("finished", c - 2.0),
                       (("prefill", c - 8.5),)),
        "r2": Timeline((("queued", c - 8.0), ("prefill", c - 7.9), ("decode", c - 7.6)), ("error", c - 6.0)),
        "r3": Timeline((("queued", c - 7.0), ("prefill", c - 6.5), ("decode", c - 6.0), ("preempted", c - 4.0),
                        ("prefill", c - 3.0), ("decode", c - 2.5)), ("aborted", c - 1.0),
                       (("prefill", c - 6.2), ("prefill", c - 6.0), ("prefill", c - 2.7), ("prefill", c - 2.5))),
        "r4": Timeline((("queued", c - 6.0), ("prefill", c - 5.8), ("decode", c - 5.0)), None,
                       tuple(("spec", c - 5.0 + 0.5 * i) for i in range(10))),
        "r5": Timeline((("queued", c - 3.0), ("prefill", c - 1.0)), None, (("prefill", c - 0.5),)),
        "r6": Timeline((("queued", c - 2.5), ("waiting-on-leader", c - 2.4))),
    }


def timeline_snapshot() -> EngineSnapshot:
    return replace(fixture_snapshot(), clock=1000.0, timelines=fixture_timelines())


def test_lane_columns_show_phases_ticks_and_the_end():
    t = fixture_timelines()["r3"]
    cells = "".join(g for g, _ in lane_cells(t, 992.0, 0.5, 16))     # 992 .. 1000 s, half a second each
    assert cells == "  ·▓████░░▓███⊘ "       # the chunk ending as decode starts is no verify round
    assert [c for _, c in lane_cells(t, 992.0, 0.5, 16)][9] == "error"       # preempted: the error colour
    r4 = "".join(g for g, _ in lane_cells(fixture_timelines()["r4"], 994.0, 0.25, 24))
    assert r4 == "·▒▒▒▓█▓█▓█▓█▓█▓█▓█▓█▓█▓█"        # a verify round every 0.5 s
    follower = "".join(g for g, _ in lane_cells(fixture_timelines()["r6"], 997.0, 1.0, 3))
    assert follower == "·~~"                                              # still waiting, up to now
    assert axis_text(30.0, 41) == "-30s      -22.5s    -15s      -7.5s   now"


def test_snapshot_timeline(frozen_app, snap_compare):
    async def show(pilot):
        frozen_app.show_snapshot(timeline_snapshot())
        await pilot.pause()
        await pilot.press("g", "plus")        # 30 s -> 10 s
        await pilot.pause()
    assert snap_compare(frozen_app, terminal_size=(120, 30), run_before=show)


async def test_g_shows_the_timeline_enter_opens_a_lane_and_space_pauses(frozen_app):
    async with frozen_app.run_test(size=(120, 30)) as pilot:
        frozen_app.show_snapshot(timeline_snapshot())
        await pilot.press("g")
        timeline = frozen_app.query_one(TimelinePanel)
        assert timeline.display and timeline.has_focus and not frozen_app.query_one("#requests").display
        assert [lane[0] for lane in timeline._lanes] == ["r6", "r5", "r4", "r3", "r2", "r1"]   # newest on top
        panel = frozen_app.query_one("#requests-panel")
        assert str(panel.border_title).startswith("timeline · 30 s · live")
        await pilot.press("down", "down", "enter")
        assert isinstance(frozen_app.screen, RequestDetail) and frozen_app.screen.request_id == "r4"
        await pilot.press("escape")
        await pilot.press("space")
        assert timeline.paused and "paused" in str(panel.border_title)
        later = replace(timeline_snapshot(), clock=1005.0)
        frozen_app.show_snapshot(later)
        assert timeline._clock == 1000.0                   # paused: the axis stands still
        await pilot.press("space", "minus")
        frozen_app.show_snapshot(later)
        assert timeline._clock == 1005.0 and timeline.span == 60.0 and "60 s · live" in str(panel.border_title)
        await pilot.press("g")
        assert frozen_app.query_one("#requests").display and str(panel.border_title) == "requests"


async def test_z_zooms_a_panel_to_the_screen_not_beyond(frozen_app):
    async with frozen_app.run_test(size=(80, 24)) as pilot:
        frozen_app.show_snapshot(fixture_snapshot())
        await pilot.press("z")
        panel = frozen_app.query_one("#requests-panel")
        assert frozen_app.screen.maximized is panel and panel.region.width == 80


async def test_only_the_lanes_on_screen_are_drawn(frozen_app, monkeypatch):
    """200 live requests: a refresh works out the visible lanes, not all of them."""
    from app.widgets import timeline as timeline_module

    base = fixture_snapshot()
    reqs = tuple(replace(base.requests[3], id=f"r{i}") for i in range(1, 201))
    lanes = {r.id: Timeline((("queued", 990.0 + i * 0.01), ("prefill", 991.0 + i * 0.01), ("decode", 992.0)),
                            None, tuple(("spec", 992.0 + k * 0.1) for k in range(80)))
             for i, r in enumerate(reqs)}
    snap = replace(base, requests=reqs, clock=1000.0, timelines=lanes)
    calls = []
    real = timeline_module.lane_cells
    monkeypatch.setattr(timeline_module, "lane_cells", lambda *a: calls.append(a) or real(*a))
    async with frozen_app.run_test(size=(200, 50)) as pilot:
        await pilot.press("g")
        frozen_app.show_snapshot(snap)
        await pilot.pause()
        timeline = frozen_app.query_one(TimelinePanel)
        assert timeline.lane_count == 200
        calls.clear()
        started = time.perf_counter()
        for _ in range(5):
            frozen_app.show_snapshot(replace(snap, clock=snap.clock + 0.2))
            await pilot.pause()
        took = (time.perf_counter() - started) / 5
        assert 0 < len(calls) <= 5 * timeline.size.height
        assert took < 0.25, f"{took * 1000:.0f} ms a refresh"


async def test_a_burst_runs_across_the_live_timeline(tiny_model, tmp_path):
    app = make_app(tiny_model, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_ready(pilot, app)
        await pilot.press("g")
        await fire_burst(pilot, app, count="4", interval="0", max_tokens="200")
        timeline = app.query_one(TimelinePanel)
        await wait_for(pilot, lambda: timeline.lane_count == 4, "four lanes")
        await wait_for(pilot, lambda: any(g == "█" for lane in timeline._lanes
                                          for g, _ in lane_cells(lane[3], timeline._clock - 5, 0.1, 50)),
                       "decode on a lane")
        def painted() -> list[str]:
            return [timeline.render_line(y).text for y in range(1, 5)]     # as painted: newest on top

        # the next refresh paints it: waited for, not assumed within a fixed pause on a busy machine
        await wait_for(pilot, lambda: any(g in line for line in painted() for g in "▒▓█"), "a phase painted")
        assert [line.split()[0] for line in painted()] == ["r4", "r3", "r2", "r1"]


# --- history charts ----------------------------------------------------------------------------
def fixture_history(clock: float = 1000.0) -> dict:
    """Five minutes of made-up points for two workers: waves, steps and a filling KV pool."""
    out = {}
    for w in range(2):
        times = tuple(float(int(clock) - 300 + i) for i in range(300))
        out[w] = History(times, {
            "prefill_tps": tuple(3000 + 1000 * math.cos(i / 30 + w) for i in range(300)),
            "decode_tps": tuple(300 + 100 * math.sin(i / 20 + w) for i in range(300)),
            "running": tuple(float(2 + (i // 40 + w) % 4) for i in range(300)),
            "waiting": tuple(float((i // 25 + w) % 3) for i in range(300)),
            "kv_usage": tuple(0.2 + 0.5 * i / 300 + 0.1 * w for i in range(300))})
    return out


def test_history_store_means_each_second_and_keeps_fifteen_minutes():
    store = HistoryStore(keep_s=3)
    stats = lambda decode, used=10, kv=None: SimpleNamespace(  # noqa: E731
        prefill_tps=0.0, decode_tps=decode, running=1, waiting=0, pages_used=used, pages_total=100 if kv is None else 0,
        kv_usage=kv)
    store.add(0, 10.1, stats(100.0))
    store.add(0, 10.6, stats(200.0, used=30))
    assert store.histories() == {}                      # the second is still open
    store.add(0, 11.0, stats(50.0))
    h = store.histories()[0]
    assert h.times == (10.0,) and h.values("decode_tps") == (150.0,) and h.values("kv_usage") == (0.2,)
    assert store.histories()[0] is h                    # nothing new: the same picture
    for t in range(12, 17):
        store.add(0, float(t), stats(float(t)))
    assert store.histories()[0].times == (13.0, 14.0, 15.0)      # the last keep_s seconds
    store.add(1, 1.0, stats(5.0, kv=None))
    store.add(1, 1.5, SimpleNamespace(prefill_tps=0.0, decode_tps=5.0, running=0, waiting=0, pages_used=0,
                                      pages_total=0, kv_usage=None))
    store.add(1, 2.0, stats(1.0))
    assert store.histories()[1].values("kv_usage") == (0.1,)     # a report without KV is left out


def test_chart_series_keep_the_window_and_scale():
    hist = fixture_history()
    names = {0: "sim:gpu0", 1: "sim:gpu1"}
    one = chart_series(hist, names, 1000.0, 60, "kv_usage", 100.0)
    assert [label for label, _, _ in one] == ["gpu0", "gpu1"]
    assert len(one[0][1]) == 60 and one[0][1][0] == -60.0 and one[0][1][-1] == -1.0
    assert one[0][2][-1] == pytest.approx(100 * (0.2 + 0.5 * 299 / 300))
    assert time_ticks(300) == ([-300.0, -225.0, -150.0, -75.0, 0.0], ["-5m", "-3.75m", "-2.5m", "-1.25m", "now"])
    assert time_ticks(60)[1] == ["-60s", "-45s", "-30s", "-15s", "now"]


def test_snapshot_history_charts_zoomed(frozen_app, snap_compare):
    async def show(pilot):
        frozen_app.show_snapshot(replace(fixture_snapshot(), clock=1000.0, history=fixture_history()))
        await pilot.pause()
        await pilot.press("h", "z")
        await pilot.pause()
    assert snap_compare(frozen_app, terminal_size=(120, 40), run_before=show)


async def test_h_shows_the_charts_and_m_cycles_their_span(frozen_app):
    async with frozen_app.run_test(size=(120, 40)) as pilot:
        snap = replace(fixture_snapshot(), clock=1000.0, history=fixture_history())
        frozen_app.show_snapshot(snap)
        await pilot.press("h")
        charts = frozen_app.query_one(HistoryCharts)
        panel = frozen_app.query_one("#streams-panel")
        assert charts.display and not frozen_app.query_one(StreamsPanel).display
        assert str(panel.border_title).startswith("history · 5 min")
        assert [label for label, _, _ in charts.plotted["decode"]] == ["gpu0", "gpu1"]
        assert [label for label, _, _ in charts.plotted["load"]] == ["gpu0", "gpu1", "gpu0 wait", "gpu1 wait"]
        assert len(charts.plotted["decode"][0][1]) == 300
        await pilot.press("m")                                    # 5 -> 15 minutes
        assert charts.window == 900 and "15 min" in str(panel.border_title)
        await pilot.press("m")                                    # -> 1 minute
        assert charts.window == 60 and len(charts.plotted["decode"][0][1]) == 60
        await pilot.press("h")
        assert frozen_app.query_one(StreamsPanel).display and str(panel.border_title) == "streams"


def test_chart_points_are_averaged_over_the_columns_fixed_in_time():
    xs = [float(x) for x in range(-10, 0)]             # ten seconds before now, clock 1000
    got_x, got_y = fit_columns(xs, [float(i) for i in range(10)], 1000.0, 4.0)
    assert got_x == [-10.0, -6.0, -2.0]                # buckets 988-992, 992-996, 996-1000 (middles)
    assert got_y == [0.5, 3.5, 7.5]                    # 990, 991 | 992..995 | 996..999
    later_x, _ = fit_columns([x - 1 for x in xs[1:]] + [-1.0], list(range(10)), 1001.0, 4.0)
    assert later_x[:2] == [-11.0, -7.0]                # a second on: the same buckets, a second older


async def test_charts_redraw_when_a_column_fills_without_a_layout_pass_and_take_no_keys(frozen_app, monkeypatch):
    """Thirty seconds of points: each chart is redrawn when a column of its dots has filled, not
    every second; the legends are in the title lines, so no widget changes size (textual-plot's
    own legend would lay the screen out at every redraw)."""
    from app.widgets import charts as charts_module

    layouts, draws = [], []
    real = charts_module.draw_chart
    monkeypatch.setattr(charts_module, "draw_chart", lambda plot, *a: draws.append(plot) or real(plot, *a))
    async with frozen_app.run_test(size=(120, 40)) as pilot:
        frozen_app.show_snapshot(replace(fixture_snapshot(), clock=1000.0, history=fixture_history()))
        await pilot.press("h")
        await pilot.pause()
        frozen_app.show_snapshot(replace(fixture_snapshot(), clock=1000.0, history=fixture_history()))
        await pilot.pause()
        title = str(frozen_app.query_one("#chart-load-title").render())
        assert title.startswith("running · waiting (dotted)") and "━ gpu0" in title and "━ gpu1" in title
        plot = frozen_app.query_one("#chart-decode", Chart)
        step = 300 / plot.dot_columns
        assert 2.0 < step < 15.0, step                 # a 5-minute window over about 30 columns
        draws.clear()
        frozen_app.screen.screen_layout_refresh_signal.subscribe(frozen_app.screen, layouts.append, immediate=True)
        for second in range(1, 31):
            frozen_app.show_snapshot(replace(fixture_snapshot(), clock=1000.0 + second,
                                             history=fixture_history(1000.0 + second)))
            await pilot.pause()
        assert layouts == []
        boundaries = int(1030 // step) - int(1000 // step)
        assert draws.count(plot) == boundaries and 2 <= boundaries < 30
        assert not any(chart.focusable for chart in frozen_app.query(Chart))    # r, arrows, + - stay the dashboard's


async def test_live_workers_fill_the_history(tiny_model, tmp_path):
    app = make_app(tiny_model, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_ready(pilot, app)
        await pilot.press("h")
        await fire_burst(pilot, app, count="4", interval="0", max_tokens="400")
        charts = app.query_one(HistoryCharts)
        await wait_for(pilot, lambda: any(max(ys, default=0) > 0 for _, _, ys in charts.plotted.get("decode", [])),
                       "decode tok/s on the chart")
        history = app.last_snapshot.history
        assert set(history) == {0, 1} and all(len(h.times) >= 1 for h in history.values())


# --- the mouse (keys stay primary) -------------------------------------------------------------
async def test_a_click_on_a_request_row_opens_its_detail(tiny_model, tmp_path):
    app = make_app(tiny_model, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_ready(pilot, app)
        await fire_burst(pilot, app, count="3", interval="0", max_tokens="4000")
        table = app.query_one(RequestsTable)
        await wait_for(pilot, lambda: table.row_count == 3, "three rows")
        await pilot.click(RequestsTable, offset=(2, 0))                  # the header: nothing
        await pilot.click(RequestsTable, offset=(2, 5))                  # below the last row: nothing
        assert app.screen is app.screen_stack[0]
        await pilot.click(RequestsTable, offset=(2, 2))                  # the second row, newest first
        await wait_for(pilot, lambda: isinstance(app.screen, RequestDetail), "the detail screen")
        assert app.screen.request_id == "r2"
        assert "prompt tokens" in str(app.screen.query_one("#detail-fields").render())
        await pilot.press("escape")
        assert table.selected_id == "r2" and not isinstance(app.screen, RequestDetail)    # x acts on it now


async def test_a_click_on_a_timeline_lane_opens_its_detail(frozen_app):
    async with frozen_app.run_test(size=(120, 30)) as pilot:
        frozen_app.show_snapshot(timeline_snapshot())
        await pilot.press("g")
        await pilot.click(TimelinePanel, offset=(20, 0))                 # the axis: nothing
        assert frozen_app.screen is frozen_app.screen_stack[0]
        await pilot.click(TimelinePanel, offset=(20, 4))                 # r6 r5 r4 r3 r2 r1: the fourth lane
        assert isinstance(frozen_app.screen, RequestDetail) and frozen_app.screen.request_id == "r3"
        await pilot.press("escape")
        assert frozen_app.query_one(TimelinePanel).selected_id == "r3"


@pytest.mark.parametrize("panel_id", ["#requests-panel", "#latency-panel", "#streams-panel"])
async def test_a_click_on_a_panel_title_zooms_it_and_again_or_escape_returns(frozen_app, panel_id):
    async with frozen_app.run_test(size=(80, 24)) as pilot:
        frozen_app.show_snapshot(fixture_snapshot())
        await pilot.pause()
        panel = frozen_app.query_one(panel_id)
        title = len(str(panel.border_title))
        await pilot.click(panel_id, offset=(title + 4, 0))              # the border past the title: nothing
        assert frozen_app.screen.maximized is None
        await pilot.click(panel_id, offset=(3, 0))
        assert frozen_app.screen.maximized is panel and panel.region.width == 80
        await pilot.click(panel_id, offset=(3, 0))                      # again: back
        assert frozen_app.screen.maximized is None
        await pilot.click(panel_id, offset=(3, 0))
        await pilot.press("escape")
        assert frozen_app.screen.maximized is None
        await pilot.click(panel_id, offset=(3, 0))
        await pilot.press("z")                                          # z too: the focus went in
        assert frozen_app.screen.maximized is None


async def test_every_footer_key_fits_at_80_columns(frozen_app):
    """At 80 columns the command palette's footer item gave way to the keys: 'q Quit' was cut
    to 'q Qu' (ctrl+p still opens the palette; the help says so)."""
    from textual.widgets._footer import FooterKey

    async with frozen_app.run_test(size=(80, 24)) as pilot:
        frozen_app.show_snapshot(fixture_snapshot())
        await pilot.pause()
        keys = list(frozen_app.query(FooterKey))
        assert keys[-1].action == "quit" and keys[-1].region.right <= 80
        assert all(key.region.width >= len(key.key_display) + len(key.description) + 1 for key in keys)
        await pilot.resize_terminal(120, 40)
        await pilot.pause()
        assert frozen_app.query_one("Footer").show_command_palette


async def test_charts_at_80x24_are_two_readable_ones_and_z_shows_all_four(frozen_app):
    """At 80x24 four charts left each three rows: frames and labels, no plot. Two fit (decode
    and KV); zoomed, all four."""
    async with frozen_app.run_test(size=(80, 24)) as pilot:
        frozen_app.show_snapshot(replace(fixture_snapshot(), clock=1000.0, history=fixture_history()))
        await pilot.press("h")
        await pilot.pause()
        await pilot.pause()
        shown = [c.id for c in frozen_app.query(Chart) if c.parent.display]
        assert shown == ["chart-decode", "chart-kv"]
        assert all(frozen_app.query_one(f"#{c}").size.height >= 4 for c in shown)
        await pilot.press("z")
        await pilot.pause()
        await pilot.pause()
        assert [c.id for c in frozen_app.query(Chart) if c.parent.display] == [
            "chart-decode", "chart-prefill", "chart-load", "chart-kv"]
