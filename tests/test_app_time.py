"""What the dashboard shows over time: the latency panel and the header's latency figures
(app/widgets/latency.py), the alert badge, every worker on screen however many there are
(app/widgets/workers.py); live on simulated workers and on hand-built snapshots."""
from __future__ import annotations

import time
from dataclasses import replace

import pytest
from textual.content import Content

from app.main import TokentopApp
from app.widgets import event_log
from app.widgets.worker import WorkerPanel
from app.widgets.worker_line import WorkerLine
from app.widgets.workers import WorkersRow
from engine.config import EngineConfig, WorkerConfig
from engine.facade.devices import parse_devices
from engine.facade.snapshot import EngineSnapshot

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
        text = plain(app._latency._shown)
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
        assert "6" in next(line for line in plain(app._latency._shown).splitlines() if line.startswith("e2e"))


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
