"""A traced burst through the real engine writes a Perfetto trace with every scope."""
import json
import time
from collections import Counter

import pytest

from engine.config import EngineConfig, SamplingParams, WorkerConfig
from engine.facade.engine import Engine
from tests.trace_checks import check_nesting

SCOPES = {"engine step", "scheduler decision", "model", "layer", "attn", "attention", "mlp",
          "qmatmul", "sampler", "selfcheck"}   # selfcheck: at start-up, before any request
OPS = {"attention-qkv", "attention-output", "mlp-gate-up", "mlp-down", "lm-head"}


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_traced_burst_has_every_scope_lifecycle_and_counter(tiny_model_path, tmp_path, mode):
    model = tiny_model_path("qwen2")
    cfg = EngineConfig(workers=(WorkerConfig(model=str(model), threads=1, calibrate=False),
                                WorkerConfig(device="sim:gpu0", name="sim:gpu0", model=str(model),
                                             sim_prefill_tps=5000, sim_decode_tps=500)),
                       worker_mode=mode, trace_dir=str(tmp_path), router_policy="round-robin")
    with Engine(cfg).start(timeout=300) as engine:
        handles = [engine.submit(f"request number {i}", params=SamplingParams(max_tokens=6))
                   for i in range(6)]
        aborted = engine.submit("to be aborted", params=SamplingParams(max_tokens=200))
        engine.abort(aborted.id)
        for h in handles + [aborted]:
            h.result(120)
        path = engine.export_trace()
    assert path.startswith(str(tmp_path))
    events = json.load(open(path))["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    names = Counter(e["name"] for e in spans)
    assert SCOPES <= set(names), SCOPES - set(names)
    assert OPS <= {e["args"].get("op") for e in spans if e["name"] == "qmatmul"}
    assert not check_nesting(events)
    # one process per worker plus the engine, each named
    procs = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert any("worker 0" in p for p in procs) and any("worker 1" in p for p in procs)
    assert any("engine" in p for p in procs)
    # every request has its lifecycle on its own track
    for h in handles:
        phases = [e["name"] for e in sorted(spans, key=lambda e: e["ts"])
                  if e.get("args", {}).get("request") == h.id]
        assert phases[:1] == ["queued"] and phases[-1] == "finished" and "decode" in phases
    aborted_phases = [e["name"] for e in spans if e.get("args", {}).get("request") == aborted.id]
    assert aborted_phases[-1] == "aborted"
    # counters move
    kv = [e["args"]["used"] for e in events if e["ph"] == "C" and e["name"] == "kv pages"]
    assert len(set(kv)) > 1
    assert any(e["name"] == "route" for e in events if e["ph"] == "i")


def test_unwritable_trace_dir_is_refused_before_any_work(tiny_model_path, tmp_path, capsys):
    from app.cli import main
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code = main(["generate", "hello", "--model", str(tiny_model_path("qwen2")),
                 "--device", "sim:gpu0", "--trace-dir", str(blocker / "traces")])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "--trace-dir" in err and "Not a directory" in err and "Traceback" not in err


def test_trace_write_error_is_one_line_and_keeps_the_events(tiny_model_path, tmp_path, monkeypatch):
    from engine.errors import TokentopError
    folder = tmp_path / "traces"
    cfg = EngineConfig(workers=(WorkerConfig(device="sim:gpu0", name="sim:gpu0",
                                             model=str(tiny_model_path("qwen2")),
                                             sim_prefill_tps=5000, sim_decode_tps=500),),
                       worker_mode="thread", trace_dir=str(folder))
    with Engine(cfg).start(timeout=60) as engine:
        result = engine.generate("traced", params=SamplingParams(max_tokens=3))
        folder.rmdir()
        folder.write_text("the folder became a file")      # e.g. removed while running
        with pytest.raises(TokentopError, match="cannot write the trace to .*the recorder keeps its events"):
            engine.export_trace()
        monkeypatch.chdir(tmp_path)
        path = engine.export_trace("elsewhere")              # relative: the absolute path comes back
    assert path.startswith(str(tmp_path / "elsewhere"))
    events = json.load(open(path))["traceEvents"]
    assert any(e.get("args", {}).get("request") == result.id for e in events)


def sim_engine_config(model, mode: str, **kw) -> EngineConfig:
    return EngineConfig(workers=tuple(WorkerConfig(device=f"sim:gpu{i}", name=f"sim:gpu{i}", model=str(model),
                                                   sim_prefill_tps=5000, sim_decode_tps=800)
                                      for i in range(2)),
                        worker_mode=mode, router_policy="round-robin", **kw)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_light_ring_alone_traces_every_request_of_a_burst(tiny_model_path, tmp_path, mode):
    """Tracing "off" (no --trace-dir, never switched on): the flight recorder still has the
    burst, each request with its whole lifecycle, every worker's steps and counters, and the
    routing decisions with their scores, in a well-formed Chrome trace; no per-layer scopes."""
    from tests.trace_checks import check_chrome_trace
    with Engine(sim_engine_config(tiny_model_path("qwen2"), mode)).start(timeout=120) as engine:
        assert not engine.tracing and engine.recorder.detail == "light"
        handles = [engine.submit(f"burst request {i}", params=SamplingParams(max_tokens=5, ignore_eos=True))
                   for i in range(8)]
        for h in handles:
            h.result(60)
        path = engine.export_trace(tmp_path / "ring.json")
    document = json.load(open(path))
    assert check_chrome_trace(document) == []
    events = document["traceEvents"]
    assert not check_nesting(events)
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert {"engine step", "scheduler decision"} <= names
    assert not names & {"model", "layer", "attn", "mlp", "qmatmul"}      # full detail only
    processes = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {"engine", "worker 0 (sim:gpu0)", "worker 1 (sim:gpu1)"}
    tracks = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {f"req {h.id}" for h in handles} <= tracks and "worker loop" in tracks
    for h in handles:
        phases = [e["name"] for e in sorted((e for e in events if e["ph"] == "X"
                                             and e.get("args", {}).get("request") == h.id), key=lambda e: e["ts"])]
        assert phases[0] == "queued" and "prefill" in phases and "decode" in phases and phases[-1] == "finished"
    routes = [e for e in events if e["ph"] == "i" and e["name"] == "route"]
    assert {e["args"]["request"] for e in routes} == {h.id for h in handles}
    assert all(set(e["args"]["scores"]) == {"0", "1"} for e in routes)    # every candidate's score
    kv = {e["pid"] for e in events if e["ph"] == "C" and e["name"] == "kv pages"}
    assert len(kv) == 2                                                   # both workers' counters
    rings = document["metadata"]["rings"]
    assert set(rings) == processes and all(r["detail"] == "light" and r["window_s"] == 120 for r in rings.values())


def test_the_trace_holds_the_last_window_only(tiny_model_path, tmp_path):
    cfg = sim_engine_config(tiny_model_path("qwen2"), "thread", trace_window_s=1.0)
    with Engine(cfg).start(timeout=60) as engine:
        old = engine.generate("long ago", params=SamplingParams(max_tokens=3))
        time.sleep(1.5)
        new = engine.generate("just now", params=SamplingParams(max_tokens=3))
        events = json.load(open(engine.export_trace(tmp_path / "t.json")))["traceEvents"]
    requests = {e["args"]["request"] for e in events if e.get("args", {}).get("request")}
    assert new.id in requests and old.id not in requests
    steps = [e["ts"] for e in events if e["name"] == "engine step"]
    assert max(steps) - min(steps) <= 1.1e6                                # µs


def test_full_detail_switches_on_and_off_at_run_time(tiny_model_path, tmp_path):
    model = tiny_model_path("qwen2")
    cfg = EngineConfig(workers=(WorkerConfig(model=str(model), threads=1, calibrate=False),), worker_mode="thread")
    with Engine(cfg).start(timeout=300) as engine:
        engine.generate("light", params=SamplingParams(max_tokens=2))
        engine.set_tracing(True)                                          # T in the dashboard
        assert engine.tracing and engine.snapshot().trace_detail == "full"
        time.sleep(0.3)                                                   # the worker takes the command
        full = engine.generate("full", params=SamplingParams(max_tokens=2))
        engine.set_tracing(False)
        assert engine.recorder.detail == "light"
        events = json.load(open(engine.export_trace(tmp_path / "t.json")))["traceEvents"]
    layers = [e for e in events if e["name"] == "layer"]
    assert layers and {e["name"] for e in events} >= {"model", "qmatmul", "engine step"}
    first = min(e["ts"] for e in events if e.get("args", {}).get("request") == full.id)
    assert all(e["ts"] >= first for e in layers)                          # none before T
