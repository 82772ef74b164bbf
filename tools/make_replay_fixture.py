"""Writes tests/data/replay_burst.rec: a few seconds of a small burst on two simulated workers,
recorded as `tokentop --record` does. The replay tests play it; run this again only when the
recording format changes (then update the replay snapshots with --snapshot-update).

    python tools/make_replay_fixture.py
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.config import EngineConfig, SamplingParams, WorkerConfig  # noqa: E402
from engine.facade.devices import parse_devices  # noqa: E402
from engine.facade.engine import Engine  # noqa: E402
from engine.facade.snapshot_file import SnapshotRecorder  # noqa: E402
from tests.fixtures.tiny_gguf import write_tiny_model  # noqa: E402

OUT = ROOT / "tests" / "data" / "replay_burst.rec"
DEVICES = ["sim:gpu0:prefill=3000,decode=60", "sim:gpu1:prefill=1500,decode=40"]
PROMPTS = ["Explain paged attention in two sentences.", "def merge(a, b):",
           "The shared design note says the scheduler admits requests in order. " * 6,
           "Write a haiku about caches.", "Summarise: the router picks the worker that finishes first.",
           "List three uses of a flight recorder."]


def main() -> int:
    model = write_tiny_model(Path(tempfile.mkdtemp()) / "tiny.gguf", "qwen2", context_length=4096)
    base = WorkerConfig(model=str(model), kv_cache_memory=2 * 2**20)
    engine = Engine(EngineConfig(workers=parse_devices(DEVICES, base), worker_mode="thread")).start()
    try:
        recorder = SnapshotRecorder(engine, OUT, command=["tokentop", "--record", OUT.name]).start()
        for i, prompt in enumerate(PROMPTS):
            engine.submit(prompt, params=SamplingParams(max_tokens=40 + 30 * i, ignore_eos=True), burst="fixture#1")
            time.sleep(0.3)
        time.sleep(5.0)
        recorder.close()
    finally:
        engine.shutdown()
    print(f"{OUT}: {OUT.stat().st_size} bytes, {recorder.frames} frames")
    return 0


if __name__ == "__main__":
    sys.exit(main())
