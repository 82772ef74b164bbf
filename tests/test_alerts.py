"""Alert rules (engine/facade/alerts.py) on made-up snapshot streams, then on a live engine."""
from __future__ import annotations

import json
import time
from dataclasses import replace

from prometheus_client.parser import text_string_to_metric_families

from engine import messages as msg
from engine.facade.alerts import THRESHOLDS, AlertMonitor
from engine.facade.snapshot import EngineSnapshot, WorkerView
from tests.waiting import wait_until

STEP = 0.5     # seconds between snapshots, as the engine's watcher looks


def worker(index: int, **kw) -> WorkerView:
    base = WorkerView(index=index, name=f"sim:gpu{index}", device=f"sim:gpu{index}", model="tiny.gguf",
                      dtype="simulated", simulated=True, state="ready", message="", running=0, waiting=0,
                      prefill_tps=0.0, decode_tps=0.0, prefill_history=(), decode_history=(), pages_total=100,
                      pages_used=0, page_states=bytes(100), page_size=16, policy="fcfs", steps=0,
                      profile_prefill_tps=0.0, profile_decode_tps=0.0, max_active=8)
    return replace(base, **kw)


def snap(t: float, *workers: WorkerView) -> EngineSnapshot:
    return EngineSnapshot(t, workers, (), (), "cost", (), False)


class Stream:
    """Feeds a monitor one snapshot every STEP seconds and keeps what it said."""

    def __init__(self) -> None:
        self.monitor = AlertMonitor()
        self.t = 0.0
        self.started: list = []
        self.ended: list = []

    def run(self, seconds: float, *workers: WorkerView) -> None:
        for _ in range(round(seconds / STEP)):
            self.t += STEP
            started, ended = self.monitor.observe(snap(self.t, *workers))
            self.started += started
            self.ended += ended

    def kinds(self) -> list[tuple[str, int]]:
        return [(a.kind, a.worker) for a in self.monitor.active()]


BUSY = dict(running=4, waiting=2, decode_tps=400.0)


def test_stall_needs_a_low_rate_waiting_requests_and_a_history():
    s = Stream()
    s.run(20, worker(0, **BUSY))
    s.run(1.5, worker(0, **{**BUSY, "decode_tps": 50.0}))
    assert s.started == []                                   # under its hold time
    s.run(1.0, worker(0, **{**BUSY, "decode_tps": 50.0}))
    assert s.kinds() == [("stall", 0)] and len(s.started) == 1
    assert "decode 50 tok/s" in s.started[0].message and "median 400 tok/s" in s.started[0].message
    s.run(90, worker(0, **{**BUSY, "decode_tps": 50.0}))    # longer than the median's window: still one
    assert len(s.started) == 1 and s.kinds() == [("stall", 0)]
    s.run(4.5, worker(0, **BUSY))                            # recovered: ends after its clear time
    assert s.ended == []
    s.run(1.0, worker(0, **BUSY))
    assert [a.kind for a in s.ended] == ["stall"] and s.kinds() == []
    s.run(20, worker(0, **BUSY))
    s.run(3, worker(0, **{**BUSY, "decode_tps": 10.0}))      # a second episode counts again
    assert s.monitor.totals == {("stall", "sim:gpu0"): 2}


def test_no_stall_without_waiting_requests_above_the_fraction_or_without_history():
    for low in (dict(BUSY, waiting=0, decode_tps=50.0), dict(BUSY, decode_tps=150.0)):
        s = Stream()
        s.run(20, worker(0, **BUSY))
        s.run(10, worker(0, **low))
        assert s.started == [], low
    s = Stream()
    s.run(3, worker(0, **BUSY))                              # too short a history to judge
    s.run(THRESHOLDS.stall_min_history_s - 4, worker(0, **{**BUSY, "decode_tps": 10.0}))
    assert s.started == []
    s = Stream()
    s.run(20, worker(0, running=0, decode_tps=0.0))          # idle samples are no baseline
    s.run(10, worker(0, **{**BUSY, "decode_tps": 10.0}))
    assert s.started == []


def test_kv_pressure_from_usage_or_recent_preemptions():
    s = Stream()
    s.run(2, worker(0, pages_used=90, preemptions=3))        # old preemptions: no alert
    assert s.started == []
    s.run(0.5, worker(0, pages_used=95, preemptions=3))
    assert s.kinds() == [("kv-pressure", 0)] and "95% of KV in use" in s.started[0].message
    s.run(5.5, worker(0, pages_used=50, preemptions=3))
    assert [a.kind for a in s.ended] == ["kv-pressure"]
    s.run(0.5, worker(0, pages_used=50, preemptions=4))      # one preemption: pressure for 10 s
    assert len(s.started) == 2 and "preempting" in s.started[1].message
    s.run(THRESHOLDS.kv_preempt_window_s, worker(0, pages_used=50, preemptions=4))
    assert s.kinds() == [("kv-pressure", 0)]
    s.run(THRESHOLDS.clear("kv-pressure") + 1, worker(0, pages_used=50, preemptions=4))
    assert s.kinds() == [] and len(s.ended) == 2
    remote = Stream()                                         # a remote: its scraped usage
    remote.run(0.5, worker(0, pages_total=0, kv_usage=0.97))
    assert remote.kinds() == [("kv-pressure", 0)]


def test_imbalance_needs_twice_the_others_queue_and_an_idle_worker():
    s = Stream()
    s.run(1.5, worker(0, running=8, waiting=6), worker(1, running=2, waiting=1), worker(2))
    assert s.started == []
    s.run(1.0, worker(0, running=8, waiting=6), worker(1, running=2, waiting=1), worker(2))
    assert s.kinds() == [("imbalance", 0)]
    assert s.started[0].message == "worker 0 (sim:gpu0) has 6 waiting while worker 2 (sim:gpu2) sits idle"
    for others in ((worker(1, running=2, waiting=4), worker(2)),          # not twice the others
                   (worker(1, running=2, waiting=1), worker(2, running=1)),   # nobody idle
                   (worker(1, running=2, waiting=1), worker(2, state="dead"))):   # the idle one is dead
        t = Stream()
        t.run(5, worker(0, running=8, waiting=6), *others)
        assert ("imbalance", 0) not in t.kinds(), others
    one = Stream()
    one.run(5, worker(0, running=8, waiting=1), worker(1))                  # a queue of one is none
    assert one.started == []


def test_a_dead_worker_once_and_a_remote_down_until_it_is_back():
    s = Stream()
    s.run(10, worker(0, state="dead", message="worker process exited (exit code -9)"), worker(1, state="down",
                                                                                           message="refused"))
    assert sorted(s.kinds()) == [("remote-down", 1), ("worker-dead", 0)] and len(s.started) == 2
    assert "exit code -9" in next(a.message for a in s.started if a.kind == "worker-dead")
    s.run(1, worker(0, state="dead"), worker(1))
    assert s.kinds() == [("worker-dead", 0)] and [a.kind for a in s.ended] == ["remote-down"]
    assert s.monitor.totals == {("worker-dead", "sim:gpu0"): 1, ("remote-down", "sim:gpu1"): 1}


def test_an_episode_is_a_start_and_an_end_marker_in_the_flight_recorder():
    """Each episode's start and end are instants in the facade's ring, on an "alerts" track."""
    from types import SimpleNamespace

    from engine.facade.alerts import AlertWatcher
    from engine.trace import Tracer

    busy = worker(0, running=1, waiting=0, pages_used=99)            # 99% of KV in use
    snaps = iter([snap(t, busy) for t in (1.0, 1.5)] + [snap(t, worker(0)) for t in (2.0, 4.0, 7.5)])
    tracer = Tracer("engine", detail="light", window_s=None)
    lines: list[str] = []
    engine = SimpleNamespace(snapshot=lambda: next(snaps), recorder=SimpleNamespace(tracer=tracer),
                             log=lambda level, text: lines.append(text))
    watcher = AlertWatcher(engine)
    for _ in range(5):
        watcher.check()
    marks = [(e["name"], e["args"]["worker"]) for e in tracer.ring() if e["ph"] == "i"]
    assert marks == [("alert: kv-pressure", 0), ("alert over: kv-pressure", 0)]
    over = [e for e in tracer.ring() if e["name"] == "alert over: kv-pressure"][0]
    assert over["args"]["lasted_s"] == 6.5 and len(lines) == 2


def test_the_engine_logs_an_episode_once_and_metrics_count_it(tiny_model_path, tmp_path):
    from engine.config import EngineConfig, WorkerConfig
    from engine.facade.devices import parse_devices
    from engine.facade.engine import Engine
    from engine.serve.metrics import EngineMetrics

    workers = parse_devices(["sim:a:prefill=5000,decode=500", "sim:b:prefill=5000,decode=500"], WorkerConfig(model=str(tiny_model_path("qwen2"))))
    with Engine(EngineConfig(workers=workers, worker_mode="thread")).start(120) as engine:
        metrics = EngineMetrics(engine, "tiny")
        engine.workers[1].send(msg.Stop())     # its loop ends: to the engine, it died
        wait_until(lambda: engine.snapshot().alerts, 10, "the dead worker's alert")
        time.sleep(4 * engine.alerts.period)             # more looks: still one line, one count
        snap = engine.snapshot()
        text = metrics.render().decode()
        trace = json.load(open(engine.export_trace(tmp_path)))["traceEvents"]    # what `t` writes
    assert [(a.kind, a.worker, a.worker_name) for a in snap.alerts] == [("worker-dead", 1, "sim:b")]
    assert sum(line.text.startswith("alert worker-dead") for line in snap.log) == 1
    assert snap.alert_counts == {("worker-dead", "sim:b"): 1}
    marks = [e for e in trace if e["ph"] == "i" and e["name"].startswith("alert")]
    assert [(e["name"], e["args"]["worker"], e["args"]["worker_name"]) for e in marks] == [
        ("alert: worker-dead", 1, "sim:b")]
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    assert tracks[marks[0]["pid"], marks[0]["tid"]] == "alerts"
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[("tokentop:alerts_total", frozenset({("model_name", "tiny"), ("kind", "worker-dead"),
                                                         ("worker", "sim:b")}))] == 1
