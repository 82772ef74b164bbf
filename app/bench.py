"""The dashboard side of `tokentop bench dashboard` (engine/bench/dashboard.py): run a piece
of engine work while the dashboard renders, in a headless Textual driver at 200x60."""
from __future__ import annotations

import asyncio
from functools import partial


def with_dashboard(config, work) -> float:
    """work(engine) with the dashboard open over an engine of `config`; its result."""
    from app.main import TokentopApp

    app = TokentopApp(config)
    result = {}

    async def drive():
        async with app.run_test(headless=True, size=(200, 60)) as pilot:
            while not app.engine.ready:
                await pilot.pause(0.1)
            result["value"] = await asyncio.to_thread(work, app.engine)
            await pilot.press("q")
    asyncio.run(drive())
    app.wait_for_shutdown()
    return result["value"]


RECORD_BURSTS = ("mixed.jsonl", "code_refactor.jsonl")   # 16 requests, their own sampling settings


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
    return bench(args, with_dashboard)
