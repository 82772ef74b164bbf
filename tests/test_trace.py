"""engine/trace.py: Chrome traces that Perfetto can read, NVTX ranges that last as long as their code.

Per-scope cost, of the order `python tests/test_trace.py` measures (it runs `_benchmark()` below:
best of 3 runs, empty-loop cost subtracted):
    disabled scope                    ~0.3 µs   (a Python `with` on a no-op object costs as much)
    enabled scope                     ~2 µs
    enabled scope + NVTX (nvtx pkg)   ~3.5 µs   (no profiler attached: nvtx's no-op domain)
"""
from __future__ import annotations

import json
import multiprocessing
import os
import re
import threading
import time
import tracemalloc

import pytest

from engine import trace
from engine.trace import Tracer, write_chrome_trace
from tests.trace_checks import check_nesting

PHASES = ["queued", "prefill", "decode", "finished"]
ATTN_OPS = ["attention-query", "attention-key", "attention-value", "attention-output"]
MLP_OPS = ["gate", "up", "down"]


def busy(us: float) -> None:
    """Spin (not sleep) so spans have a measurable, known minimum length."""
    end = time.perf_counter_ns() + int(us * 1000)
    while time.perf_counter_ns() < end:
        pass


def fake_forward(layers: int = 2) -> None:
    """The engine's scope structure, looked up through get_tracer() like deep code does."""
    t = trace.get_tracer()
    with t.scope("model", tokens=3):
        for i in range(layers):
            with t.scope("layer", index=i):
                with t.scope("attn"):
                    for op in ATTN_OPS:
                        with t.scope("qmatmul", op=op):
                            busy(5)
                with t.scope("mlp"):
                    for op in MLP_OPS:
                        with t.scope("qmatmul", op=op):
                            busy(5)
    sample()


def sample() -> int:
    with trace.get_tracer().scope("sampler"):   # the tracer is looked up at each call
        busy(5)
        return 7


def worker_loop(tracer: Tracer, thread_name: str, steps: int) -> None:
    trace.set_tracer(tracer)
    tracer.set_thread_name(thread_name)
    for step in range(steps):
        with tracer.scope("scheduler", step=step):
            busy(3)
        fake_forward()
        tracer.counter("kv_pages", used=10 + step, free=90 - step)


def spawned_worker(label: str, queue: multiprocessing.Queue) -> None:
    """A worker in its own OS process: records, then ships drain() over a queue."""
    tracer = Tracer(label, enabled=True)
    worker_loop(tracer, "loop", steps=2)
    queue.put(tracer.drain())


def spans(events: list[dict], name: str | None = None) -> list[dict]:
    return [e for e in events if e["ph"] == "X" and (name is None or e["name"] == name)]


def names_by_track(events: list[dict]) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in events
            if e["ph"] == "M" and e["name"] == "thread_name"}


@pytest.fixture(autouse=True)
def unbind_tracer():
    previous = trace.set_tracer(None)
    yield
    trace.set_tracer(previous)


def test_traced_workload_is_a_valid_nested_trace(tmp_path):
    tracer = Tracer("worker cpu:0", enabled=True)
    threads = [threading.Thread(target=worker_loop, args=(tracer, f"loop-{n}", 3)) for n in "ab"]
    for t in threads:
        t.start()
    # three overlapping request lifecycles, recorded from the main thread meanwhile
    script = [("r1", "queued"), ("r2", "queued"), ("r1", "prefill"), ("r3", "queued"),
              ("r2", "prefill"), ("r1", "decode"), ("r3", "prefill"), ("r2", "decode"),
              ("r1", "finished"), ("r3", "decode"), ("r3", "finished"), ("r2", "finished")]
    for request_id, phase in script:
        tracer.request_phase(request_id, phase)
        busy(20)
    for t in threads:
        t.join()

    path = write_chrome_trace(tmp_path, tracer.drain())
    with open(path) as f:
        document = json.load(f)
    events = document["traceEvents"]
    assert document["displayTimeUnit"] == "ms"
    assert document["metadata"]["dropped_events"] == 0

    process_names = [e for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    assert [e["args"]["name"] for e in process_names] == ["worker cpu:0"]
    assert process_names[0]["pid"] == trace.synthetic_pid("worker cpu:0")
    track_names = names_by_track(events)
    assert sorted(track_names.values()) == ["loop-a", "loop-b", "req r1", "req r2", "req r3"]

    assert check_nesting(events) == []
    loop_tracks = [track for track, name in track_names.items() if name.startswith("loop")]
    for track in loop_tracks:
        on_track = [e for e in spans(events) if (e["pid"], e["tid"]) == track]
        assert len([e for e in on_track if e["name"] == "model"]) == 3
        qmatmuls = [e for e in on_track if e["name"] == "qmatmul"]
        assert len(qmatmuls) == 3 * 2 * (len(ATTN_OPS) + len(MLP_OPS))
        assert {e["args"]["op"] for e in qmatmuls} == set(ATTN_OPS + MLP_OPS)
        assert all(e["dur"] >= 5 for e in qmatmuls)        # the 5 µs busy body is inside
        assert len([e for e in on_track if e["name"] == "sampler"]) == 3

    for request_id in ("r1", "r2", "r3"):
        phases = sorted((e for e in spans(events) if e.get("args", {}).get("request") == request_id),
                        key=lambda e: e["ts"])
        assert [e["name"] for e in phases] == PHASES
        assert len({(e["pid"], e["tid"]) for e in phases}) == 1          # one track each
        for before, after in zip(phases, phases[1:]):                   # back to back
            assert before["ts"] + before["dur"] == pytest.approx(after["ts"], abs=1e-3)
        assert all(e["dur"] >= 20 for e in phases[:-1])

    counters = [e for e in events if e["ph"] == "C" and e["name"] == "kv_pages"]
    assert len(counters) == 6
    assert len({e["args"]["used"] for e in counters}) == 3
    assert len({e["args"]["free"] for e in counters}) == 3


def test_worker_processes_share_one_clock_and_get_one_process_each(tmp_path):
    """A spawned worker and a thread-mode worker merge into one trace on a common timeline."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    before = time.perf_counter_ns() / 1000
    child = ctx.Process(target=spawned_worker, args=("worker cpu:1", queue))
    child.start()
    child_events = queue.get(timeout=60)
    child.join(timeout=30)
    after = time.perf_counter_ns() / 1000
    assert child.exitcode == 0

    local = Tracer("worker cpu:0", enabled=True)
    worker_loop(local, "loop", steps=1)
    path = write_chrome_trace(tmp_path / "merged.json", child_events + local.drain())
    with open(path) as f:
        events = json.load(f)["traceEvents"]

    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {trace.synthetic_pid("worker cpu:0"): "worker cpu:0",
                         trace.synthetic_pid("worker cpu:1"): "worker cpu:1"}
    child_spans = [e for e in spans(events) if e["pid"] == trace.synthetic_pid("worker cpu:1")]
    assert len([e for e in child_spans if e["name"] == "model"]) == 2
    # CLOCK_MONOTONIC is system-wide: the child's spans fall inside our own before/after
    assert all(before <= e["ts"] and e["ts"] + e["dur"] <= after for e in child_spans)
    assert check_nesting(events) == []


class RecordingNvtx:
    """An NVTX stand-in: logs each call with its time; push returns what Nsight would."""

    def __init__(self, push_returns: object) -> None:
        self.push_returns = push_returns
        self.calls: list[tuple[str, str | None, int | None, int]] = []
        self.depth = 0

    def push_range(self, message: str, color: int) -> object:
        self.calls.append(("push", message, color, time.perf_counter_ns()))
        self.depth += 1
        return self.push_returns

    def pop_range(self) -> object:
        self.calls.append(("pop", None, None, time.perf_counter_ns()))
        self.depth -= 1
        return self.push_returns

    def kinds(self) -> list[str]:
        return [c[0] for c in self.calls]


@pytest.mark.parametrize("push_returns", [-1, 0, None], ids=["nsight(-1)", "zero", "none"])
def test_nvtx_range_lasts_exactly_as_long_as_the_body(push_returns):
    nvtx = RecordingNvtx(push_returns)
    tracer = Tracer("worker cuda:0", enabled=True, nvtx=nvtx)
    with tracer.scope("qmatmul", op="attention-query", rows=17):
        body_start = time.perf_counter_ns()
        assert nvtx.kinds() == ["push"] and nvtx.depth == 1   # still open inside the body
        busy(2000)
        assert nvtx.kinds() == ["push"]
        body_end = time.perf_counter_ns()
    assert nvtx.kinds() == ["push", "pop"]
    (_, message, color, pushed_at), (_, _, _, popped_at) = nvtx.calls
    assert message == "qmatmul op=attention-query"     # numbers stay out of NVTX labels
    assert color == trace.SCOPE_COLORS["qmatmul"]
    assert pushed_at <= body_start and body_end <= popped_at
    assert popped_at - pushed_at >= 2_000_000
    span, = spans(tracer.drain(), "qmatmul")
    assert body_end - body_start <= span["dur"] * 1000 <= popped_at - pushed_at


def test_nvtx_pops_once_per_push_when_nested_and_when_the_body_raises():
    nvtx = RecordingNvtx(-1)
    tracer = Tracer("worker cuda:0", nvtx=nvtx)      # NVTX only, no Chrome events
    with pytest.raises(ValueError, match="boom"):
        with tracer.scope("model"):
            with tracer.scope("layer", index=0):
                with tracer.scope("attn"):
                    assert nvtx.depth == 3
                    raise ValueError("boom")
    assert nvtx.kinds() == ["push"] * 3 + ["pop"] * 3
    assert nvtx.depth == 0
    assert [c[1] for c in nvtx.calls[:3]] == ["model", "layer", "attn"]
    assert spans(tracer.drain()) == []


def test_scope_colours_are_distinct_for_the_engine_scopes():
    names = ["model", "layer", "attn", "qmatmul", "sampler"]
    assert len({trace.scope_color(n) for n in names}) == len(names)
    assert trace.scope_color("something-new") == trace.scope_color("something-new")


def test_real_nvtx_package_backend_runs_without_a_profiler():
    tracer = Tracer("worker cpu:0", enabled=True, nvtx=True)
    assert isinstance(tracer._nvtx, trace.NvtxPackageBackend)
    with tracer.scope("model"):
        with tracer.scope("qmatmul", op="attention-key"):
            pass
    assert [e["name"] for e in spans(tracer.drain())] == ["qmatmul", "model"]


def test_disabled_tracer_records_nothing_reads_no_clock_and_writes_no_file(tmp_path, monkeypatch):
    tracer = trace.get_tracer()                 # nothing bound: the shared disabled tracer
    assert not tracer.active
    def no_clock() -> int:
        raise AssertionError("a disabled tracer read the clock")
    monkeypatch.setattr(trace, "_now_ns", no_clock)
    first = tracer.scope("model")
    assert tracer.scope("qmatmul", op="gate") is first                # one shared no-op
    with first:
        fake_forward()
    tracer.counter("kv_pages", used=1)
    tracer.instant("preempted")
    tracer.request_phase("r1", "queued")
    assert [e for e in tracer.drain() if e["ph"] != "M"] == []
    assert Tracer("idle").write(tmp_path) is None
    assert os.listdir(tmp_path) == []


def test_traced_and_get_tracer_follow_the_thread_binding():
    tracer = Tracer("worker cpu:0", enabled=True)
    trace.set_tracer(tracer)
    seen: list[Tracer] = []
    other = threading.Thread(target=lambda: (seen.append(trace.get_tracer()), sample()))
    other.start()
    other.join()
    assert seen[0] is not tracer and not seen[0].active   # other threads stay unbound
    assert sample() == 7
    assert [e["name"] for e in spans(tracer.drain())] == ["sampler"]


def test_directory_writes_never_overwrite_even_within_one_millisecond(tmp_path, monkeypatch):
    class FrozenClock:
        @staticmethod
        def now():
            from datetime import datetime
            return datetime(2026, 11, 29, 9, 30, 12, 123456)
    monkeypatch.setattr(trace, "datetime", FrozenClock)
    paths = [write_chrome_trace(tmp_path, [{"ph": "i", "name": f"n{i}", "pid": 1, "tid": 1,
                                            "ts": 0.0, "s": "t"}]) for i in range(3)]
    assert [os.path.basename(p) for p in paths] == [
        "tokentop-20261129-093012-123.json",
        "tokentop-20261129-093012-123-1.json",
        "tokentop-20261129-093012-123-2.json"]
    for i, p in enumerate(paths):
        with open(p) as f:
            assert json.load(f)["traceEvents"][0]["name"] == f"n{i}"


def test_real_clock_file_names_are_timestamped_and_new(tmp_path):
    tracer = Tracer("worker cpu:0", enabled=True)
    written = []
    for _ in range(2):
        with tracer.scope("model"):
            pass
        written.append(tracer.write(tmp_path / "traces"))
    assert len(set(written)) == 2
    for p in written:
        assert re.fullmatch(r"tokentop-\d{8}-\d{6}-\d{3}(-\d+)?\.json", os.path.basename(p))


def test_ring_buffer_keeps_the_newest_events_and_counts_the_dropped(tmp_path):
    tracer = Tracer("worker cpu:0", enabled=True, max_events=10)
    for i in range(25):
        with tracer.scope("step", i=i):
            pass
    first = tracer.drain()
    assert [e["args"]["i"] for e in spans(first)] == list(range(15, 25))
    for i in range(12):                          # a second batch: only its own drops count
        tracer.request_phase(f"r{i}", "queued")
        tracer.request_phase(f"r{i}", "finished")
    second = tracer.drain()
    assert len(spans(second)) == 10
    path = write_chrome_trace(tmp_path / "t.json", first + second)
    with open(path) as f:
        metadata = json.load(f)["metadata"]
    assert metadata["dropped_events"] == 15 + 14
    assert metadata["dropped_events_by_process"] == {"worker cpu:0": 29}


def test_drain_while_another_thread_records_loses_nothing():
    tracer = Tracer("worker cpu:0", enabled=True)
    total = 20_000
    def record():
        for i in range(total):
            with tracer.scope("step", i=i):
                pass
    recorder = threading.Thread(target=record)
    recorder.start()
    batches = []
    while recorder.is_alive():
        batches.append(tracer.drain())
    recorder.join()
    batches.append(tracer.drain())
    seen = [e["args"]["i"] for batch in batches for e in spans(batch)]
    assert seen == list(range(total))
    assert all(e["args"]["count"] == 0 for b in batches for e in b if e["name"] == "tokentop_dropped_events")


def test_check_nesting_reports_partial_overlap():
    def x(name, ts, dur, tid=1):
        return {"ph": "X", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}
    nested = [x("outer", 0.0, 10.0), x("inner", 2.0, 3.0), x("tail", 5.0, 5.0), x("next", 10.0, 1.0)]
    assert check_nesting(nested) == []
    crossing = [x("a", 0.0, 10.0), x("b", 5.0, 10.0)]
    problems = check_nesting(crossing)
    assert len(problems) == 1 and "'b'" in problems[0] and "'a'" in problems[0]
    assert check_nesting([x("a", 0.0, 10.0), x("b", 5.0, 10.0, tid=2)]) == []   # other track


class FakeClock:
    """perf_counter_ns for a simulated hour: advanced by hand, read by the tracer."""

    def __init__(self) -> None:
        self.ns = 10**12

    def __call__(self) -> int:
        return self.ns

    def advance(self, seconds: float) -> None:
        self.ns += int(seconds * 1e9)


def simulated_worker_second(tracer: Tracer, clock: FakeClock, steps: int, first_request: int) -> None:
    """One second of a busy worker at light detail: steps, counters, a routed request."""
    for step in range(steps):
        with tracer.span("engine step", step=step):
            clock.advance(0.5 / steps)
        tracer.counter("kv pages", used=100 + step, cached=7, free=400 - step)
        tracer.counter("requests", running=8, waiting=step % 5)
        clock.advance(0.5 / steps)
    rid = f"r{first_request}"
    tracer.instant("route", request=rid, chosen=1, policy="cost", reason="lowest estimated finish",
                   scores={0: 0.61, 1: 0.42}, reuse={0: 0, 1: 32})
    start = clock.ns - 900_000_000
    tracer.request_lifecycle(rid, [("queued", start), ("prefill", start + 10**7), ("decode", start + 2 * 10**7)],
                             ("finished", clock.ns), worker=1)


def test_flight_recorder_keeps_the_last_window_through_an_hour(monkeypatch):
    """An hour of fake time at 10 steps/s: the ring holds the last 120 s, no more, and the
    memory Python holds for it stops growing once the window is full."""
    clock = FakeClock()
    monkeypatch.setattr(trace, "_now_ns", clock)
    tracer = Tracer("worker 0 (sim:gpu0)", detail="light", window_s=120, max_bytes=64 * 2**20)
    tracemalloc.start()
    try:
        held = {}
        for second in range(3600):
            simulated_worker_second(tracer, clock, 10, second)
            if second % 600 == 599:
                held[second // 60 + 1] = tracemalloc.get_traced_memory()[0]
                assert tracer.ring_bytes <= 64 * 2**20
                oldest = min(e["ts"] for e in tracer.ring() if e["ph"] != "M")
                assert clock.ns / 1000 - oldest <= 121e6     # µs: nothing older than the window
                assert clock.ns / 1000 - oldest >= 119e6     # and the whole window is there
    finally:
        tracemalloc.stop()
    # 10 min in, the window has long been full: from then on memory stays flat
    assert held[60] <= held[10] * 1.02 + 64 * 1024, held
    assert tracer.drain()[-1]["name"] != "tokentop_dropped_events"   # only age pushed events out


def test_flight_recorder_memory_stays_under_its_budget_through_an_hour(monkeypatch):
    """A small budget (256 KiB) against an hour of events: the estimate never passes it, and
    what CPython really allocates for the ring (tracemalloc) stays under it too."""
    clock = FakeClock()
    monkeypatch.setattr(trace, "_now_ns", clock)
    budget = 256 * 1024
    tracer = Tracer("engine", detail="light", window_s=120, max_bytes=budget)
    simulated_worker_second(tracer, clock, 5, 0)     # the tracer's own fixed state, first
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for second in range(1, 3600):
            simulated_worker_second(tracer, clock, 5, second)
            assert tracer.ring_bytes <= budget
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown <= budget, f"the ring holds {grown} bytes for a {budget}-byte budget"
    events = tracer.ring()
    ring = next(e for e in events if e["name"] == "tokentop_ring")["args"]
    assert ring["dropped_total"] > 0 and ring["max_bytes"] == budget
    newest = max(e["ts"] for e in events if e["ph"] != "M")
    assert newest == pytest.approx(clock.ns / 1000, abs=1e6)          # the newest events stay


def test_record_size_estimate_is_an_upper_bound():
    """record_bytes() against tracemalloc, for the records the engine makes most."""
    def step(t, i):
        with t.span("engine step", step=i):
            pass
    def counters(t, i):
        t.counter("kv pages", used=1000 + i, cached=i, free=10**6 - i)
    def deep(t, i):
        with t.scope("qmatmul", op="attention-qkv", kernel="avx2"):
            pass
    def route(t, i):
        t.instant("route", request=f"r{i}", chosen=1, policy="cost", reason="lowest estimated finish",
                  scores={0: i * 0.001, 1: 0.5}, reuse={0: 0, 1: 16})
    for record in (step, counters, deep, route):
        tracer = Tracer("size", detail="full", window_s=None, max_bytes=None)
        record(tracer, 0)
        n = 5_000
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for i in range(1, n + 1):
                record(tracer, i)
            real = (tracemalloc.get_traced_memory()[0] - before) / n
        finally:
            tracemalloc.stop()
        estimated = tracer.ring_bytes / (n + 1)
        assert real <= estimated, f"{record.__name__}: {real:.0f} bytes allocated, {estimated:.0f} estimated"


def test_light_detail_records_spans_but_not_deep_scopes():
    tracer = Tracer("worker 0 (cpu)", detail="light")
    trace.set_tracer(tracer)
    with tracer.span("engine step", step=1):
        fake_forward(layers=1)
    tracer.counter("kv pages", used=3)
    names = [e["name"] for e in tracer.ring() if e["ph"] in "XC"]
    assert names == ["engine step", "kv pages"] and not tracer.active
    tracer.set_detail("full")
    assert tracer.active
    with tracer.span("engine step", step=2):
        fake_forward(layers=1)
    assert {"model", "layer", "qmatmul", "sampler"} <= {e["name"] for e in tracer.ring()}
    tracer.set_detail("off")
    with tracer.span("engine step", step=3):
        pass
    assert [e["args"]["step"] for e in tracer.ring() if e["name"] == "engine step"] == [1, 2]
    with pytest.raises(ValueError, match="off, light, full"):
        tracer.set_detail("verbose")


def test_nvtx_when_full_follows_the_detail():
    nvtx = RecordingNvtx(-1)
    tracer = Tracer("worker cuda:0", detail="light", nvtx=nvtx, nvtx_when_full=True)
    with tracer.scope("layer"):
        pass
    assert nvtx.calls == [] and not tracer.active
    tracer.set_detail("full")
    with tracer.span("engine step"):
        with tracer.scope("layer"):
            pass
    assert nvtx.kinds() == ["push", "push", "pop", "pop"]


def test_ring_copy_leaves_the_ring_and_spans_the_window(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(trace, "_now_ns", clock)
    tracer = Tracer("engine", detail="light", window_s=10)
    for i in range(30):
        tracer.instant("tick", i=i)
        clock.advance(1.0)
    first, second = tracer.ring(), tracer.ring()
    assert first == second
    assert [e["args"]["i"] for e in first if e["name"] == "tick"] == list(range(20, 30))


def _benchmark(n: int = 200_000) -> None:
    def per_scope_ns(tracer: Tracer) -> float:
        start = time.perf_counter_ns()
        for _ in range(n):
            with tracer.scope("qmatmul", op="attention-query"):
                pass
        loop = time.perf_counter_ns()
        for _ in range(n):
            pass
        empty = time.perf_counter_ns() - loop
        tracer.drain()
        return (loop - start - empty) / n

    tracers = {"disabled": Tracer("bench"), "enabled": Tracer("bench", enabled=True),
               "enabled+nvtx": Tracer("bench", enabled=True, nvtx=True)}
    for label, tracer in tracers.items():
        best = min(per_scope_ns(tracer) for _ in range(3))
        print(f"{label:14s} {best / 1000:7.3f} µs per scope")


if __name__ == "__main__":
    _benchmark()
