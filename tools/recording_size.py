"""How big a `--record` file grows: a 16-request burst on two simulated workers, recorded.

    python tools/recording_size.py [--seconds 60] [--model PATH.gguf] [--out FILE]

The burst is sample_prompts/mixed.jsonl and code_refactor.jsonl (16 requests, their own
sampling settings, max_tokens raised so the burst runs most of the recording), fired at once
on sim:gpu0 and sim:gpu1 behind the cost router, recorded at 5 frames a second. Prints the
file's size, bytes per frame and per minute, and what the same frames take uncompressed.
Without --model, a tiny random GGUF stands in (only its tokenizer and KV geometry are used).
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.bursts import load_burst  # noqa: E402
from engine.config import EngineConfig, WorkerConfig  # noqa: E402
from engine.facade.devices import parse_devices  # noqa: E402
from engine.facade.engine import Engine  # noqa: E402
from engine.facade.snapshot_file import SnapshotRecorder, read_recording  # noqa: E402

DEVICES = ["sim:gpu0:prefill=4000,decode=120", "sim:gpu1:prefill=2500,decode=90"]
FILES = ("mixed.jsonl", "code_refactor.jsonl")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--model", default=None)
    p.add_argument("--out", default=None, help="keep the recording here")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp())
    model = args.model
    if model is None:
        from tests.fixtures.tiny_gguf import write_tiny_model
        model = str(write_tiny_model(work / "tiny.gguf", "qwen2", context_length=8192))
    items = [item for name in FILES for item in load_burst(ROOT / "sample_prompts" / name)]
    assert len(items) == 16
    base = WorkerConfig(model=model, kv_cache_memory=8 * 2**20)
    engine = Engine(EngineConfig(workers=parse_devices(DEVICES, base), worker_mode="thread")).start()
    out = Path(args.out or work / "burst.rec")
    try:
        recorder = SnapshotRecorder(engine, out).start()
        for item in items:
            params = replace(item.params, max_tokens=max(item.params.max_tokens, 600))
            engine.submit(item.prompt, messages=item.messages, params=params, burst="size#1")
        time.sleep(args.seconds)
        recorder.close()
    finally:
        engine.shutdown()
    rec = read_recording(out)
    size = out.stat().st_size
    raw = len(gzip.decompress(out.read_bytes()))
    finished = sum(r.state == "finished" for r in rec.frame(len(rec) - 1)[0].requests)
    print(json.dumps({
        "seconds": args.seconds, "frames": len(rec), "requests_finished": finished,
        "bytes": size, "bytes_per_frame": round(size / len(rec)), "bytes_per_minute": round(size * 60 / args.seconds),
        "uncompressed_bytes_per_minute": round(raw * 60 / args.seconds), "file": str(out)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
