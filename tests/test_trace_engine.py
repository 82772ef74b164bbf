"""A traced burst through the real engine writes a Perfetto trace with every scope."""
import json
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
        with pytest.raises(TokentopError, match="cannot write the trace to .*kept for the next export"):
            engine.export_trace()
        monkeypatch.chdir(tmp_path)
        path = engine.export_trace("elsewhere")              # relative: the absolute path comes back
    assert path.startswith(str(tmp_path / "elsewhere"))
    events = json.load(open(path))["traceEvents"]
    assert any(e.get("args", {}).get("request") == result.id for e in events)
