"""`tokentop bench SCENARIO`: measured comparisons, JSON out (stdout, and --out FILE).

Each scenario compares its variants side by side in one run, interleaved, and reports
medians and ratios, together with the command line that produced them.
"""
from __future__ import annotations

import json
import sys
import time
from importlib import import_module
from typing import Iterator, NamedTuple


class Scenario(NamedTuple):
    """A benchmark: `function(args) -> report` in `module`, and the line `bench --help` shows."""
    module: str
    function: str
    summary: str


# Every benchmark, by the name `tokentop bench NAME` takes. `dashboard` and `record` need the
# UI or its burst files: the command line runs them through the functions it hands run_bench.
SCENARIOS: dict[str, Scenario] = {
    "single": Scenario("scenarios", "bench_single", "prefill and one-stream decode tok/s per model"),
    "batching": Scenario("scenarios", "bench_batching", "N concurrent requests vs one after another"),
    "routing": Scenario("scenarios", "bench_routing", "routing policies over unequal workers"),
    "trace": Scenario("scenarios", "bench_trace", "what the flight recorder costs"),
    "prefix": Scenario("prefix", "bench_prefix", "prefix reuse: warm vs cold, single flight"),
    "serve": Scenario("serve", "bench_serve", "the HTTP API vs in-process"),
    "spec": Scenario("spec", "bench_spec", "speculative decoding vs target-only"),
    "router": Scenario("router_cost", "bench_router", "one routing decision's cost"),
    "soak": Scenario("soak", "bench_soak", "minutes of mixed load with faults"),
    "first-start": Scenario("first_start", "bench_first_start", "a fresh install: time to serve, to the kernels"),
    "dashboard": Scenario("dashboard", "bench_dashboard", "the engine's throughput with the dashboard open"),
    "record": Scenario("record", "bench_record", "how big a recording grows"),
    "rows": Scenario("rows", "bench_rows", "a decode step's cost by its row count, with roofline shares"),
}


def scenario_function(name: str):
    """The function that runs scenario `name`, its module imported now (they import torch)."""
    scenario = SCENARIOS[name]
    return getattr(import_module(f"engine.bench.{scenario.module}"), scenario.function)


def run_bench(args, extra: dict | None = None) -> int:
    """Run `args.scenario`, one of SCENARIOS; `extra` (name -> function) is how the command line
    runs the scenarios that need the UI."""
    from engine.bench import common
    from engine.bench.common import command_line, machine

    fn = (extra or {}).get(args.scenario) or scenario_function(args.scenario)
    common.TRACE_DIR = args.trace_dir
    started = time.time()
    report = fn(args)
    report = {
        "scenario": args.scenario,
        "command": command_line(sys.argv[1:]),
        "machine": machine(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "seconds": round(time.time() - started, 1),
        **report,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    # a part that could not run (an unknown model, a reference that failed) is in the report;
    # it also makes the command fail, with one line each, so a script cannot miss it
    failures = list(failed_parts(report))
    for where, error in failures:
        print(f"tokentop: error: bench {args.scenario}: {where}: {error}", file=sys.stderr)
    return 1 if failures else 0


def failed_parts(node, where: str = "report") -> Iterator[tuple[str, str]]:
    """(where, error) for every dict of the report with an "error": named by its "model" where it
    has one, else by its path."""
    if isinstance(node, dict):
        here = str(node.get("model") or where)
        if node.get("error"):
            yield here, str(node["error"])
        for key, value in node.items():
            if key != "error":
                yield from failed_parts(value, key if here == "report" else f"{here}.{key}")
    elif isinstance(node, list):
        for value in node:
            yield from failed_parts(value, where)


