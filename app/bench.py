"""`tokentop bench dashboard`: the engine's throughput headless and with the dashboard open.

It lives on the app side because it drives the dashboard; the engine's own scenarios are in
engine/bench/.
"""
from __future__ import annotations

import asyncio

from engine.bench.scenarios import _burst, _decode_burst_tok_s, base_worker
from engine.config import EngineConfig
from engine.stats import median


def bench_dashboard(args) -> dict:
    """The same burst through the engine headless, and with the dashboard open (rendering
    at 200x60 in a headless Textual driver). Workers run in their own processes in both."""
    from engine.facade.devices import parse_devices
    from engine.facade.engine import Engine

    runs = 1 if args.quick else args.runs
    n, out_tokens = 8, (16 if args.quick else 64)
    workers = parse_devices(args.device or ["cpu"], base_worker(args))
    config = EngineConfig(workers=workers, worker_mode="process")

    def headless() -> float:
        with Engine(config).start() as engine:
            _burst(engine, 2, 4, True, "warm")
            return _decode_burst_tok_s(engine, n, out_tokens, "headless")

    def with_dashboard() -> float:
        from app.main import TokentopApp
        app = TokentopApp(config)
        result = {}

        async def drive():
            async with app.run_test(headless=True, size=(200, 60)) as pilot:
                while not app.engine.ready:
                    await pilot.pause(0.1)
                await asyncio.to_thread(_burst, app.engine, 2, 4, True, "warm")
                result["tok_s"] = await asyncio.to_thread(
                    _decode_burst_tok_s, app.engine, n, out_tokens, "dashboard")
                await pilot.press("q")
        asyncio.run(drive())
        app.wait_for_shutdown()
        return result["tok_s"]

    a, b = [], []
    for _ in range(runs):
        a.append(headless())
        b.append(with_dashboard())
    return {"requests": n, "output_tokens": out_tokens, "runs": runs,
            "headless_tok_s": median(a), "dashboard_tok_s": median(b),
            "dashboard_over_headless": round(median(b) / median(a), 3),
            "headless_runs": a, "dashboard_runs": b,
            "goals": {"dashboard_costs_le_5pct": median(b) / median(a) >= 0.95}}


APP_SCENARIOS = {"dashboard": bench_dashboard}
