"""`tokentop bench SCENARIO`: measured comparisons, JSON out (stdout, and --out FILE).

Each scenario compares its variants side by side in one run, interleaved, and reports
medians and ratios, together with the command line that produced them.
"""
from __future__ import annotations

import json
import platform
import statistics
import sys
import time

import torch


def run_bench(args) -> int:
    from engine.bench import scenarios

    fn = getattr(scenarios, f"bench_{args.scenario}")
    scenarios.TRACE_DIR = args.trace_dir
    started = time.time()
    report = fn(args)
    report = {
        "scenario": args.scenario,
        "command": "tokentop " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("tokentop")
        else " ".join(["tokentop", *sys.argv[1:]]),
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
    return 0


def machine() -> dict:
    import os
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "processor": platform.processor() or platform.machine()}


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def p95(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


def peak_rss_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
