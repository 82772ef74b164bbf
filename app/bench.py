"""The dashboard side of `tokentop bench dashboard` (engine/bench/dashboard.py): run a piece
of engine work while the dashboard renders, in a headless Textual driver at 200x60."""
from __future__ import annotations

import asyncio
from functools import partial


OPEN_PANELS = ("g", "h")     # the timeline and the history charts, beside the latency panel
SETTLE_S = 1.0               # the burst is timed on a dashboard already showing them


def with_dashboard(config, work) -> float:
    """work(engine) with the dashboard open over an engine of `config`, every time panel shown
    (latency, timeline, history charts); its result."""
    from app.main import TokentopApp

    app = TokentopApp(config)
    result = {}

    async def drive():
        async with app.run_test(headless=True, size=(200, 60)) as pilot:
            while not app.engine.ready:
                await pilot.pause(0.1)
            await pilot.press(*OPEN_PANELS)
            await pilot.pause(SETTLE_S)     # the panels' first layout and draw: once, not per frame
            result["value"] = await asyncio.to_thread(work, app.engine)
            await pilot.press("q")
    asyncio.run(drive())
    app.wait_for_shutdown()
    return result["value"]


RECORD_BURSTS = ("mixed.jsonl", "code_refactor.jsonl")   # 16 requests, their own sampling settings


def frame_ms(config, n_live: int, frames: int) -> dict:
    """One dashboard frame (the snapshot taken, every panel updated, the screen drawn) with
    `n_live` requests live on the engine, in a headless Textual driver at 200x60: the median
    milliseconds per frame (wall clock, and the UI thread's CPU time), with the request table
    and with the timeline (g) shown, and how many layout refreshes the timed frames caused.

    Frames are REFRESH_S apart, as the dashboard takes them, so each one shows what the engine
    did meanwhile. A frame ends when every message it caused is handled and the screen drawn
    (pilot.pause(0)); pilot.pause() would add its idle wait, sleeps of 20 ms until one passes
    without work, to every frame."""
    import statistics
    import time

    from app.main import REFRESH_S, TokentopApp
    from engine.config import SamplingParams

    app = TokentopApp(config, live=False)
    wall: dict[str, list[float]] = {"table": [], "timeline": []}
    cpu: dict[str, list[float]] = {"table": [], "timeline": []}
    layouts = [0]
    timing = [False]

    def count_layout(_screen) -> None:
        layouts[0] += timing[0]

    async def drive():
        async with app.run_test(headless=True, size=(200, 60)) as pilot:
            await asyncio.to_thread(app.engine.start)   # live=False: no 5 Hz refresh between the timed frames
            app.settle_heap()                           # as the live dashboard does once its workers are up
            app.screen.screen_layout_refresh_signal.subscribe(app.screen, count_layout, immediate=True)
            handles = [app.engine.submit(f"frame cost {i}", params=SamplingParams(max_tokens=4000, ignore_eos=True))
                       for i in range(n_live)]
            for view in ("table", "timeline"):
                if view == "timeline":
                    await pilot.press("g")
                for _ in range(frames):
                    await asyncio.sleep(REFRESH_S)
                    timing[0] = True
                    t0, c0 = time.perf_counter(), time.thread_time()
                    app.show_snapshot(app.engine.snapshot())
                    await pilot.pause(0)
                    wall[view].append((time.perf_counter() - t0) * 1e3)
                    cpu[view].append((time.thread_time() - c0) * 1e3)
                    timing[0] = False
            live = sum(r.finish_reason is None for r in app.last_snapshot.requests)
            for h in handles:
                app.engine.abort(h.id)
            await pilot.press("q")
            wall["live_at_end"] = live
    asyncio.run(drive())
    app.engine.shutdown()
    report = {"live_requests": wall.pop("live_at_end"), "frames": frames, "layout_refreshes": layouts[0]}
    for view in ("table", "timeline"):
        report[f"{view}_frame_ms"] = round(statistics.median(wall[view]), 2)
        report[f"{view}_frame_cpu_ms"] = round(statistics.median(cpu[view]), 2)
    return report


CHART_SIZE = (100, 30)     # one history chart zoomed at 200x60 (h, z: four charts, two by two)


def chart_ms(redraws: int) -> dict:
    """One history chart redrawn (app/widgets/charts.py draw_chart: cleared, four series of 900
    points plotted, axes, title line; then the screen drawn) at CHART_SIZE in a headless Textual
    driver: the running and waiting requests of two workers over 15 minutes, each redraw one
    second later (the charts take a point a second). Median milliseconds per redraw, wall clock
    and the UI thread's CPU time, and the layout refreshes the timed redraws caused."""
    import math
    import statistics
    import time

    from textual.app import App
    from textual.containers import Vertical

    from app.widgets.charts import Chart, draw_chart
    from app.widgets.line import Line

    points = 900

    def drawn(t: int) -> list:
        xs = [float(i - points) for i in range(points)]
        out = []
        for w in range(2):
            running = [float(4 + round(3 * math.sin((t + i) / (25 + 10 * w)))) for i in range(points)]
            waiting = [float(max(0, round(4 * math.sin((t + i) / 40 + w)))) for i in range(points)]
            out += [(f"gpu{w}", xs, running, ""), (f"gpu{w} wait", xs, waiting, " wait")]
        return out

    class OneChart(App):
        def compose(self):
            with Vertical():
                yield Line(id="title")
                yield Chart(id="chart")

    app = OneChart()
    wall, cpu, layouts, timing = [], [], [0], [False]

    async def drive():
        async with app.run_test(headless=True, size=CHART_SIZE) as pilot:
            await pilot.pause()
            app.screen.screen_layout_refresh_signal.subscribe(
                app.screen, lambda _: layouts.__setitem__(0, layouts[0] + timing[0]), immediate=True)
            plot, title, colours = app.query_one(Chart), app.query_one(Line), app.theme_variables
            for t in range(redraws + 3):            # the first three warm up
                await asyncio.sleep(0.02)
                timing[0] = t >= 3
                t0, c0 = time.perf_counter(), time.thread_time()
                draw_chart(plot, title, "load", drawn(t), 900, colours)
                await pilot.pause(0)
                await pilot.pause(0)        # the plot's canvases repaint on the cycle after it renders
                if timing[0]:
                    wall.append((time.perf_counter() - t0) * 1e3)
                    cpu.append((time.thread_time() - c0) * 1e3)
                timing[0] = False
    asyncio.run(drive())
    return {"widget": "textual-plot", "size": f"{CHART_SIZE[0]}x{CHART_SIZE[1]}", "series": 4, "points": points,
            "redraws": redraws, "redraw_ms": round(statistics.median(wall), 2),
            "redraw_cpu_ms": round(statistics.median(cpu), 2), "layout_refreshes": layouts[0]}


def app_scenarios() -> dict:
    """The scenarios the command line adds to engine/bench's: those that need the UI or its
    burst files."""
    from engine.bench.dashboard import bench_dashboard
    from engine.bench.record import bench_record
    return {"dashboard": partial(_dashboard, bench_dashboard), "record": partial(_record, bench_record)}


def _record(bench, args) -> dict:
    from app.bursts import default_prompts_dir, load_burst
    items = [item for name in RECORD_BURSTS for item in load_burst(default_prompts_dir() / name)]
    return bench(args, items)


def _dashboard(bench, args) -> dict:
    return bench(args, with_dashboard, frame_ms, chart_ms)
