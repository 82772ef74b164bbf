"""`tokentop bench dashboard`: the engine's throughput headless and with the dashboard open.

The engine cannot import the UI, so the command line hands the scenario the function that
runs a piece of work with the dashboard open over an engine (app/bench.py); the measuring
is here, beside the other scenarios.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from engine.bench.common import base_worker, decode_burst_tok_s, timed_burst
from engine.config import EngineConfig
from engine.stats import median

# with_dashboard(config, work) -> work(engine)'s result, run while the dashboard renders
DashboardDriver = Callable[[EngineConfig, Callable], float]


FRAME_REQUESTS = 200    # live requests behind the frame-cost figure
FRAME_GOAL_MS = 25.0
SIM_FRAME_DEVICE = "sim:gpu0:prefill=20000,decode=20"   # slow decode: the requests stay live


def bench_dashboard(args, with_dashboard: DashboardDriver, frame_ms=None, chart_ms=None) -> dict:
    """The same burst through the engine headless, and with the dashboard open (rendering
    at 200x60 in a headless Textual driver, the latency panel, the timeline and the history
    charts shown), workers in their own processes in both; then,
    with frame_ms (app/bench.py), what one frame costs with 200 requests live (a simulated
    worker keeps them live: its rates are labelled simulated, the frame is real); with chart_ms,
    what redrawing one history chart costs (four series of 900 points)."""
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
    report = {"requests": n, "output_tokens": out_tokens, "runs": runs,
              "headless_tok_s": median(a), "dashboard_tok_s": median(b),
              "dashboard_over_headless": round(median(b) / median(a), 3),
              "headless_runs": a, "dashboard_runs": b,
              "goals": {"dashboard_costs_le_5pct": median(b) / median(a) >= 0.95}}
    if frame_ms is not None:
        sim = parse_devices([SIM_FRAME_DEVICE], replace(base_worker(args), max_active=64,
                                                         kv_cache_memory=256 * 2**20))
        frame = frame_ms(EngineConfig(workers=sim, worker_mode="thread"), FRAME_REQUESTS, 5 if args.quick else 30)
        report["frame"] = {**frame, "device": SIM_FRAME_DEVICE, "goal_ms": FRAME_GOAL_MS}
        report["goals"]["frame_le_25ms_at_200_live"] = max(frame["table_frame_ms"],
                                                           frame["timeline_frame_ms"]) <= FRAME_GOAL_MS
    if chart_ms is not None:
        report["chart"] = chart_ms(10 if args.quick else 60)
    return report
