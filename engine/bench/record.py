"""`tokentop bench record`: how big a `--record` file grows for a 16-request burst.

The burst (sample_prompts/mixed.jsonl and code_refactor.jsonl, read by the command line and
handed in, max_tokens raised so it runs most of the recording) is fired at once on two
simulated workers behind the cost router and recorded at 5 frames a second; the report gives
the file's bytes per frame and per minute, and what the same frames take uncompressed.
"""
from __future__ import annotations

import gzip
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from engine.bench.common import base_worker
from engine.config import EngineConfig

DEVICES = ["sim:gpu0:prefill=4000,decode=120", "sim:gpu1:prefill=2500,decode=90"]
GOAL_BYTES_PER_MINUTE = 1_000_000


def bench_record(args, items: list) -> dict:
    from engine.facade.devices import parse_devices
    from engine.facade.engine import Engine
    from engine.facade.recording_read import read_recording
    from engine.facade.snapshot_file import SnapshotRecorder

    seconds = 10.0 if args.quick else 60.0
    workers = parse_devices(DEVICES, base_worker(args, kv_cache_memory=8 * 2**20))
    engine = Engine(EngineConfig(workers=workers, worker_mode="thread")).start()
    out = Path(tempfile.mkdtemp()) / "burst.rec"
    try:
        recorder = SnapshotRecorder(engine, out).start()
        for item in items:
            params = replace(item.params, max_tokens=max(item.params.max_tokens, 600))
            engine.submit(item.prompt, messages=item.messages, params=params, burst="record#1")
        time.sleep(seconds)
        recorder.close()
    finally:
        engine.shutdown()
    rec = read_recording(out)
    size = out.stat().st_size
    raw = len(gzip.decompress(out.read_bytes()))
    finished = sum(r.state == "finished" for r in rec.frame(len(rec) - 1)[0].requests)
    per_minute = round(size * 60 / seconds)
    return {"seconds": seconds, "requests": len(items), "frames": len(rec), "requests_finished": finished,
            "bytes": size, "bytes_per_frame": round(size / len(rec)), "bytes_per_minute": per_minute,
            "uncompressed_bytes_per_minute": round(raw * 60 / seconds),
            "goals": {"record_le_1mb_per_minute": per_minute <= GOAL_BYTES_PER_MINUTE}}
