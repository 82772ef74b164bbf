"""`tokentop bench first-start`: how long a fresh install takes to serve, and to switch to the kernels.

A child process starts an engine with one CPU worker and the default model on an empty cache
directory (TOKENTOP_CACHE_DIR), as a fresh install does: the model is assembled from its PyPI
packages, the worker starts its kernel build in the background and serves on torch matmuls,
and switches between two steps once the kernels are built. The child sends one short greedy
request as soon as the engine is ready and then one every second; the report gives, from the
child's start: model assembled, engine ready, first token, kernels switched (from the log
line), and the decode rate before and after the switch. Goal: serving within 30 s.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

GOAL_READY_S = 30.0

CHILD = r'''
import json, sys, time
t0 = time.monotonic()
from engine.config import EngineConfig, SamplingParams, WorkerConfig
from engine.facade.engine import Engine
from engine.models.catalog import resolve_model
model, threads, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
resolve_model(model)
out = {"model_assembled_s": time.monotonic() - t0}
engine = Engine(EngineConfig(workers=(WorkerConfig(model=model, threads=threads, calibrate=False),),
                             worker_mode="process")).start()
out["ready_s"] = time.monotonic() - t0
rates = []
try:
    while time.monotonic() - t0 < limit:
        res = engine.generate("The capital of France is", params=SamplingParams(max_tokens=16, ignore_eos=True))
        if "first_token_s" not in out:
            out["first_token_s"] = out["ready_s"] + (res.metrics.ttft or 0.0)
        view = engine.snapshot().workers[0]
        rates.append((time.monotonic() - t0, view.kernels_building, 15 / max(res.metrics.e2e - res.metrics.ttft, 1e-6)))
        if not view.kernels_building:
            if "kernels" not in out:
                switched = [l for l in engine.snapshot().log if "switched to the quantized kernels" in l.text
                            or "stays on torch" in l.text]
                out["kernels"] = view.kernels
                out["kernels_switched_s"] = next((r[0] for r in rates if not r[1]), None)
                out["switch_line"] = switched[0].text if switched else ""
            if sum(not r[1] for r in rates) >= 4:   # the decode rate on the kernels, warmed up
                break
            continue
        time.sleep(1.0)
finally:
    engine.shutdown()
before = [r[2] for r in rates if r[1]]
after = [r[2] for r in rates if not r[1]][1:]   # the first call after the switch warms the new model up
out["fallback_decode_tok_s"] = sorted(before)[len(before) // 2] if before else None
out["kernels_decode_tok_s"] = sorted(after)[len(after) // 2] if after else None
print("REPORT " + json.dumps(out))
'''


def bench_first_start(args) -> dict:
    limit = 120.0 if args.quick else 600.0
    with tempfile.TemporaryDirectory(prefix="tokentop-fresh-") as cache:
        env = dict(os.environ, TOKENTOP_CACHE_DIR=cache)
        proc = subprocess.run([sys.executable, "-c", CHILD, args.model, str(args.worker.threads or 2), str(limit)],
                              env=env, capture_output=True, text=True, timeout=limit + 300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    if proc.returncode != 0 or not lines:
        return {"error": f"the fresh start failed: {(proc.stderr or proc.stdout).strip()[-500:]}"}
    report = {k: round(v, 2) if isinstance(v, float) else v for k, v in json.loads(lines[-1][7:]).items()}
    report["model"] = args.model
    report["goals"] = {"serves_within_30s": report.get("first_token_s", 1e9) <= GOAL_READY_S}
    return report
