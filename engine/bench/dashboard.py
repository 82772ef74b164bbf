"""`tokentop bench dashboard`: the engine's throughput headless and with the dashboard open.

The engine cannot import the UI, so the command line hands the scenario the function that
runs a piece of work with the dashboard open over an engine (app/bench.py); the measuring
is here, beside the other scenarios.
"""
from __future__ import annotations

from typing import Callable

from engine.bench.scenarios import base_worker, decode_burst_tok_s, timed_burst
from engine.config import EngineConfig
from engine.stats import median

# with_dashboard(config, work) -> work(engine)'s result, run while the dashboard renders
DashboardDriver = Callable[[EngineConfig, Callable], float]


def bench_dashboard(args, with_dashboard: DashboardDriver) -> dict:
    """The same burst through the engine headless, and with the dashboard open (rendering
    at 200x60 in a headless Textual driver). Workers run in their own processes in both."""
    from engine.facade.devices import parse_devices
    from engine.facade.engine import Engine

    runs = 1 if args.quick else args.runs
    n, out_tokens = 8, (16 if args.quick else 64)
    workers = parse_devices(args.device or ["cpu"], base_worker(args))
    config = EngineConfig(workers=workers, worker_mode="process")

    def work(engine, label: str) -> float:
        timed_burst(engine, 2, 4, True, "warm")
        return decode_burst_tok_s(engine, n, out_tokens, label)

    def headless() -> float:
        with Engine(config).start() as engine:
            return work(engine, "headless")

    a, b = [], []
    for _ in range(runs):
        a.append(headless())
        b.append(with_dashboard(config, lambda engine: work(engine, "dashboard")))
    return {"requests": n, "output_tokens": out_tokens, "runs": runs,
            "headless_tok_s": median(a), "dashboard_tok_s": median(b),
            "dashboard_over_headless": round(median(b) / median(a), 3),
            "headless_runs": a, "dashboard_runs": b,
            "goals": {"dashboard_costs_le_5pct": median(b) / median(a) >= 0.95}}
