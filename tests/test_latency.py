"""Latency percentiles over windows (engine/facade/latency.py), checked against numpy.

numpy's "inverted_cdf" percentile is the nearest-rank definition the engine uses: the smallest
sample with at least q% of the samples at or below it.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from engine import messages as msg
from engine.facade import latency as L
from engine.stats import percentile


def numpy_summary(values) -> tuple:
    if not len(values):
        return (0, None, None, None)
    return (len(values), *(float(np.percentile(values, q, method="inverted_cdf")) for q in L.QUANTILES))


def as_tuple(s: L.Summary) -> tuple:
    return (s.count, s.p50, s.p95, s.p99)


@pytest.mark.parametrize("seed", range(30))
def test_kth_of_union_is_the_merged_order(seed):
    rng = random.Random(seed)
    a = sorted(rng.choice([rng.random(), round(rng.random(), 1)]) for _ in range(rng.randint(0, 40)))
    b = sorted(round(rng.random(), 1) for _ in range(rng.randint(0, 8)))
    merged = sorted(a + b)
    for k in range(1, len(merged) + 1):
        assert L.kth_of_union(a, b, k) == merged[k - 1]


@pytest.mark.parametrize("seed", range(20))
def test_summaries_match_numpy_and_engine_stats(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400))
    values = rng.lognormal(-3, 1.5, n)
    split = int(rng.integers(0, n + 1))
    a, b = sorted(values[:split].tolist()), sorted(values[split:].tolist())
    bins = np.searchsorted(np.array(L.HIST_EDGES[1:-1]), values, side="right")
    # the session's sorted lists, and a window's array with the live samples beside it
    for s in (L.summarise(a, b, hist=True), L.summarise(np.array(a), b, hist=True)):
        assert as_tuple(s) == numpy_summary(values)
        assert [s.p50, s.p95, s.p99] == [percentile(values.tolist(), q) for q in L.QUANTILES]
        assert list(s.hist) == np.bincount(bins, minlength=L.HIST_BINS).tolist()


def test_empty_and_single_sample_windows():
    assert L.summarise([], [], hist=True) == L.Summary(0, None, None, None, (0,) * L.HIST_BINS)
    one = L.summarise([0.25], [])
    assert as_tuple(one) == (1, 0.25, 0.25, 0.25) == numpy_summary([0.25])
    window = L.LatencyWindow()
    views = window.views(100.0)
    assert set(views) == {"10s", "60s", "session"}
    assert all(v.summary(m).count == 0 for v in views.values() for m in L.METRICS)
    window.add([("ttft", 0, 95.0, 0.5)])
    views = window.views(100.0)
    assert as_tuple(views["10s"].summary("ttft")) == (1, 0.5, 0.5, 0.5)
    assert as_tuple(views["10s"].summary("ttft", 0)) == (1, 0.5, 0.5, 0.5)
    assert views["10s"].summary("e2e").count == 0
    later = window.views(106.0)          # 11 s after it: out of the 10 s window only
    assert later["10s"].summary("ttft").count == 0 and later["60s"].summary("ttft").count == 1
    gone = window.views(200.0)
    assert gone["60s"].summary("ttft").count == 0 and gone["session"].summary("ttft").count == 1


@pytest.mark.parametrize("seed", range(10))
def test_windows_and_workers_match_numpy_on_random_streams(seed):
    rng = np.random.default_rng(100 + seed)
    now = 1000.0
    window = L.LatencyWindow()
    finished = []
    for _ in range(int(rng.integers(0, 300))):
        finished.append((str(rng.choice(L.METRICS)), int(rng.integers(0, 3)),
                         float(now - rng.uniform(0, 120)), float(rng.exponential(0.2))))
    window.add(finished)
    live = [(str(rng.choice(L.METRICS)), int(rng.integers(0, 3)), float(now - rng.uniform(0, 30)),
             float(rng.exponential(0.2))) for _ in range(int(rng.integers(0, 20)))]
    views = window.views(now, live)
    for name, seconds in L.WINDOWS:
        start = -np.inf if seconds is None else now - seconds
        for metric in L.METRICS:
            for worker in (None, 0, 1, 2):
                want = [v for m, w, t, v in finished + live
                        if m == metric and (worker is None or w == worker) and t >= start]
                assert as_tuple(views[name].summary(metric, worker)) == numpy_summary(want), (name, metric, worker)


def test_session_keeps_the_latest_samples(monkeypatch):
    monkeypatch.setattr(L, "SESSION_SAMPLES", 50)
    window = L.LatencyWindow()
    window.add([("e2e", 0, float(i), float(i)) for i in range(120)])     # value = age order
    session = window.views(10_000.0)["session"].summary("e2e")
    assert session.count == 50
    assert as_tuple(session) == numpy_summary(np.arange(70, 120, dtype=float))


def record(**kw):
    base = dict(worker=1, arrival=10.0, metrics=None, finished_at=None, finish_reason=None,
                prefill_at=None, first_token_at=None, last_token_at=None, output_ids=[])
    return SimpleNamespace(**{**base, **kw})


def test_a_requests_samples_are_timed_when_they_happened():
    m = msg.RequestMetrics(prompt_tokens=5, cached_tokens=0, output_tokens=11, queue_time=0.5, ttft=1.0,
                           itl_mean=0.1, itl_max=0.3, e2e=2.0)
    done = record(metrics=m, finished_at=12.0, finish_reason="stop")
    assert L.finished_samples(done) == [("queue", 1, 10.5, 0.5), ("ttft", 1, 11.0, 1.0),
                                        ("itl", 1, 12.0, 0.1), ("e2e", 1, 12.0, 2.0)]
    aborted = record(metrics=m, finished_at=12.0, finish_reason="abort")
    assert [s[0] for s in L.finished_samples(aborted)] == ["queue", "ttft", "itl"]   # no e2e
    running = record(prefill_at=10.25, first_token_at=10.75, last_token_at=11.75, output_ids=[1] * 5)
    assert L.live_samples(running, 12.0) == [("queue", 1, 10.25, 0.25), ("ttft", 1, 10.75, 0.75),
                                             ("itl", 1, 12.0, 0.25)]
    assert L.live_samples(record(), 12.0) == []                 # still queued: nothing known yet
    assert L.live_samples_of([running, done], 12.0) == L.live_samples(running, 12.0)


def test_the_engines_snapshot_carries_its_requests_percentiles(tiny_model_path):
    """On simulated workers: the snapshot's figures are its own requests' figures, per worker too."""
    from engine.config import EngineConfig, SamplingParams, WorkerConfig
    from engine.facade.devices import parse_devices
    from engine.facade.engine import Engine

    workers = parse_devices(["sim:a:prefill=20000,decode=2000", "sim:b:prefill=20000,decode=2000"],
                            WorkerConfig(model=str(tiny_model_path("qwen2")), max_active=4))
    with Engine(EngineConfig(workers=workers, worker_mode="thread", router_policy="round-robin")).start(120) as engine:
        assert all(v.summary(m).count == 0 for v in engine.snapshot().latency.values() for m in L.METRICS)
        handles = [engine.submit(f"request {i}", params=SamplingParams(max_tokens=4 + i)) for i in range(9)]
        engine.submit("aborted one", params=SamplingParams(max_tokens=5000)).abort()
        for h in handles:
            h.result(30)
        snap = engine.snapshot()
    done = [r for r in snap.requests if r.finish_reason == "length"]
    assert len(done) == 9
    for name in ("10s", "session"):
        view = snap.latency[name]
        assert as_tuple(view.summary("e2e")) == numpy_summary([r.e2e for r in done])
        assert as_tuple(view.summary("ttft")) == numpy_summary([r.ttft for r in snap.requests if r.ttft is not None])
        assert as_tuple(view.summary("itl")) == numpy_summary([r.itl_mean for r in snap.requests
                                                               if r.itl_mean is not None])
        for w in (0, 1):
            assert view.summary("e2e", w).count == sum(r.worker == w for r in done)
        assert sum(view.summary("e2e").hist) == 9
