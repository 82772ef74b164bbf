"""Prefix reuse through the engine on simulated workers: hits, routing on reuse estimates,
the cache-aware policy's failure modes, and a randomized stress run."""
import random
import time
import zlib

import pytest

from engine import messages as msg
from engine.config import EngineConfig, SamplingParams, WorkerConfig
from engine.facade.devices import parse_devices
from engine.facade.engine import Engine
from engine.facade.router import Router, WorkerLoad

FAST = "prefill=20000,decode=5000"


def sim_engine(model, specs, mode="thread", worker_kw=None, **kw):
    base = WorkerConfig(model=str(model), **{"max_active": 4, **(worker_kw or {})})
    return Engine(EngineConfig(workers=parse_devices(specs, base), worker_mode=mode, **kw)).start(timeout=120)


@pytest.fixture
def model(tiny_model_path):
    return tiny_model_path("qwen2")


def doc_ids(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(10, 200) for _ in range(n)]


def settle(engine, timeout=10.0):
    time.sleep(0.5)                            # a fresh WorkerStats (5 Hz) after the last step
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = engine.snapshot()
        if all(w.running == 0 and w.waiting == 0 and w.pages_used == 0 for w in snap.workers):
            return snap
        time.sleep(0.05)
    raise AssertionError("workers did not settle")


def test_warm_request_restores_the_prefix_and_counts_it(model):
    with sim_engine(model, [f"sim:a:{FAST}"]) as engine:
        doc = doc_ids(100)
        engine.submit(prompt_ids=doc + [5], params=SamplingParams(max_tokens=2)).result(10)
        time.sleep(0.3)                        # step events carry the published keys
        h = engine.submit(prompt_ids=doc + [6, 7], params=SamplingParams(max_tokens=2))
        r = h.result(10)
        assert r.metrics.cached_tokens == 96   # 6 full pages of 16
        assert engine.snapshot().routing[-1].chosen_reuse == 96   # the router saw it coming
        salted = engine.submit(prompt_ids=doc + [6, 7], params=SamplingParams(max_tokens=2),
                               cache_salt="tenant-b").result(10)
        assert salted.metrics.cached_tokens == 0
        snap = settle(engine)
        w = snap.workers[0]
        assert w.prefix_cache and w.prefix["prefix_cache_hits"] == 96
        assert w.prefix["prefix_cache_queries"] == 101 + 102 + 102
        assert w.prefix["cached_pages"] > 0 and w.pages_used == 0


def test_cache_off_restores_nothing(model):
    with sim_engine(model, [f"sim:a:{FAST}"], worker_kw={"prefix_cache": "off"}) as engine:
        doc = doc_ids(100)
        engine.submit(prompt_ids=doc + [5], params=SamplingParams(max_tokens=2)).result(10)
        r = engine.submit(prompt_ids=doc + [6], params=SamplingParams(max_tokens=2)).result(10)
        assert r.metrics.cached_tokens == 0
        assert not engine.snapshot().workers[0].prefix_cache


def test_identical_burst_waits_on_one_leader(model):
    # 200 tokens in steps of at most 80: the followers wait through the leader's first two
    # chunks, then join the step that computes its last pages (160..199)
    with sim_engine(model, ["sim:a:prefill=2000,decode=2000"], worker_kw={"max_batched_tokens": 80}) as engine:
        doc = doc_ids(200)
        handles = [engine.submit(prompt_ids=doc, params=SamplingParams(max_tokens=3)) for _ in range(4)]
        seen_follow = set()
        while not all(h.done for h in handles):
            for r in engine.snapshot().requests:
                if r.leader:
                    seen_follow.add((r.id, r.leader))
            time.sleep(0.005)
        cached = sorted(h.result().metrics.cached_tokens for h in handles)
        assert cached == [0, 192, 192, 192]
        assert {leader for _, leader in seen_follow} == {handles[0].id}
        assert all(h.result().metrics.follow_time > 0 for h in handles[1:])
        prefix = settle(engine).workers[0].prefix
        assert prefix["single_flight_waits"] == 3 and prefix["single_flight_joins"] == 3


def test_identical_burst_within_one_step_joins_without_waiting(model):
    """A prompt within the step's budget: the followers join the leader's only prefill step
    (submitted together, they are in the worker's queue before it plans that step)."""
    with sim_engine(model, ["sim:a:prefill=2000,decode=2000"]) as engine:
        doc = doc_ids(200)
        handles = [engine.submit(prompt_ids=doc, params=SamplingParams(max_tokens=3)) for _ in range(4)]
        results = [h.result(10) for h in handles]
        assert sorted(r.metrics.cached_tokens for r in results) == [0, 192, 192, 192]
        prefix = settle(engine).workers[0].prefix
        assert prefix["prefix_cache_hits"] == 3 * 192
        assert prefix["single_flight_joins"] + prefix["single_flight_waits"] == 3
        assert prefix["single_flight_joins"] >= 1


# --- cache-aware routing ---------------------------------------------------------------------
def loads(*works):
    """Workers with the given outstanding seconds of decode work (rate 100 tok/s)."""
    return [WorkerLoad(i, f"w{i}", 1000.0, 100.0, decode_tokens=int(w * 100)) for i, w in enumerate(works)]


def test_cache_aware_prefers_the_longest_prefix_when_balanced():
    r = Router("cache-aware")
    d = r.choose("x", 500, 10, loads(1.0, 0.0), cached={0: 480, 1: 0})
    assert d.chosen == 0 and d.reason == "longest prefix"
    assert {c.worker: c.cached_tokens for c in d.candidates} == {0: 480, 1: 0}


def test_cache_aware_hot_prefix_does_not_pile_up():
    r = Router("cache-aware")
    d = r.choose("x", 500, 10, loads(5.0, 0.5), cached={0: 480, 1: 0})
    assert d.chosen == 1 and d.reason == "imbalanced"       # absolute AND relative exceeded
    d = r.choose("x", 500, 10, loads(12.0, 9.0), cached={0: 480, 1: 0})
    assert d.chosen == 0                                    # 3 s apart but only 1.33x: balanced


def test_cache_aware_miss_goes_to_the_soonest_finish_not_the_emptiest_cache():
    r = Router("cache-aware")
    # worker 0 has an empty cache but 1.5 s queued; worker 1 a full cache and no work
    d = r.choose("x", 500, 10, loads(1.5, 0.0), cached={1: 0})
    assert d.chosen == 1 and d.reason == "miss"


def test_hot_prefix_spreads_over_simulated_workers(model, tmp_path):
    log = tmp_path / "routes.jsonl"
    specs = ["sim:a:prefill=4000,decode=100", "sim:b:prefill=4000,decode=100"]
    with sim_engine(model, specs, router_policy="cache-aware", routing_log=str(log)) as engine:
        doc = doc_ids(200)
        engine.submit(prompt_ids=doc + [1], params=SamplingParams(max_tokens=2), worker=0).result(10)
        time.sleep(0.3)
        handles = [engine.submit(prompt_ids=doc + [i, i + 1], params=SamplingParams(max_tokens=40))
                   for i in range(2, 26)]
        for h in handles:
            h.result(60)
        decisions = list(engine.snapshot().routing)[-24:]
        per_worker = [sum(d.chosen == w for d in decisions) for w in (0, 1)]
        assert min(per_worker) >= 4, per_worker                 # the idle worker was used
        assert any(d.reason == "longest prefix" and d.chosen_reuse == 192 for d in decisions)
        assert any(d.reason == "imbalanced" for d in decisions)
        assert '"cached_tokens": 192' in log.read_text()          # --routing-log records reuse


# --- stress ----------------------------------------------------------------------------------
def slot_bytes(path):
    import torch

    from engine.models.batch import KVStore
    from engine.models.gguf import load_gguf
    c = load_gguf(str(path)).config
    return KVStore.bytes_per_slot(c.n_layers, c.n_kv_heads, c.head_dim, torch.float32)


def finished_events(handle):
    events = []
    while not handle._q.empty():
        events.append(handle._q.get_nowait())
    return [e for e in events if isinstance(e, msg.Finished)]


@pytest.mark.parametrize("single_flight", ["after-prefill", "at-completion", "off"])
def test_randomized_stress_accounts_for_every_page_and_handle(model, single_flight, monkeypatch):
    import functools

    import engine.worker.setup
    from engine.worker.scheduler import Scheduler
    # admissions overcommit (2 tokens of decode headroom), so preemption happens often
    monkeypatch.setattr(engine.worker.setup, "Scheduler", functools.partial(Scheduler, decode_headroom=2))
    rng = random.Random(zlib.crc32(single_flight.encode()))   # the same run in every process
    docs = [doc_ids(rng.randrange(20, 60), seed=s) for s in range(6)]
    specs = ["sim:a:prefill=200000,decode=50000", "sim:b:prefill=200000,decode=50000"]
    # a small pool: preemption and eviction happen all the time
    kw = {"single_flight": single_flight, "kv_cache_memory": 32 * 16 * slot_bytes(model),
          "max_active": 8, "max_batched_tokens": 64}
    with sim_engine(model, specs, worker_kw=kw, router_policy="cache-aware") as engine:
        pages = engine.snapshot().workers[0].pages_total
        assert pages < 80
        handles = []
        for i in range(240):
            doc = rng.choice(docs)
            tail = [rng.randrange(10, 200) for _ in range(rng.randrange(1, 12))]
            salt = rng.choice([None, None, None, "t1"])
            long = rng.random() < 0.3                         # outgrows the admission headroom
            h = engine.submit(prompt_ids=doc + tail, cache_salt=salt,
                              params=SamplingParams(max_tokens=rng.randrange(150, 185) if long
                                                    else rng.randrange(1, 40)))
            handles.append(h)
            if rng.random() < 0.15:
                rng.choice(handles).abort()                  # some mid-prefill leaders among them
            if rng.random() < 0.1:
                time.sleep(0.01)
        deadline = time.monotonic() + 120
        for h in handles:
            assert h._done.wait(max(0.1, deadline - time.monotonic())), f"{h.id} never finished"
        snap = settle(engine)
        for w in snap.workers:
            assert w.pages_used == 0                          # free + cached == total
            assert w.prefix["waiting_on_leader"] == 0
        assert sum(w.prefix["evictions"] for w in snap.workers) > 0
        assert sum(w.prefix["prefix_cache_hits"] for w in snap.workers) > 0
        for h in handles:
            assert len(finished_events(h)) == 1, h.id         # every handle finished exactly once
        reasons = {h.result().finish_reason for h in handles}
        assert "abort" in reasons and "length" in reasons and "error" not in reasons
        assert sum(h.result().metrics.preemptions for h in handles if h.result().metrics) > 0


def test_leader_aborted_mid_prefill_leaves_no_follower_hanging(model):
    kw = {"max_batched_tokens": 32}
    with sim_engine(model, ["sim:a:prefill=400,decode=1000"], worker_kw=kw) as engine:
        doc = doc_ids(200)
        handles = [engine.submit(prompt_ids=doc + [i], params=SamplingParams(max_tokens=2))
                   for i in range(3)]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            views = {r.id: r for r in engine.snapshot().requests}
            if views[handles[1].id].leader == handles[0].id and views[handles[0].id].cached_tokens == 0 \
                    and 0 < views[handles[0].id].prompt_tokens:
                break
            time.sleep(0.01)
        else:
            raise AssertionError("no follower seen")
        handles[0].abort()
        rest = [h.result(20) for h in handles[1:]]
        assert handles[0].result(5).finish_reason == "abort"
        assert all(r.finish_reason == "length" for r in rest)
        assert rest[1].metrics.cached_tokens > 0       # it followed the new leader (or the cache)
        snap = settle(engine)
        assert snap.workers[0].pages_used == 0 and snap.workers[0].prefix["waiting_on_leader"] == 0


def test_bench_prefix_runs_end_to_end_on_a_tiny_model(tmp_path, capsys):
    """The benchmark's plumbing (not its figures): every scenario reports, outputs are equal."""
    import json

    from app.cli import main
    from tests.fixtures.tiny_gguf import write_tiny_model
    path = write_tiny_model(tmp_path / "tiny.gguf", context_length=2048)
    out = tmp_path / "prefix.json"
    assert main(["bench", "prefix", "--quick", "--model", str(path), "--threads", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["warm_vs_cold"]["restored_tokens"] >= 880 - 16
    eight = report["identical"][-1]
    assert eight["n"] == 8 and eight["independent"]["restored_tokens"] == [0] * 8
    assert eight["after-prefill"]["restored_tokens"][1:] == [528] * 7
    assert min(report["partial_prefix"][0]["after-prefill"]["restored_tokens"][1:]) >= 800
    assert report["cyclic"]["errors"] == 0 and report["cyclic"]["pages_used_after"] == 0
    assert report["equality"]["identical_together"] and report["equality"]["identical_one_by_one"]
    assert report["machine"]["cpu_model"]


def test_trace_shows_publish_hit_evict_and_waiting_on_leader(model, tmp_path):
    kw = {"max_batched_tokens": 32, "kv_cache_memory": 20 * 16 * slot_bytes(model)}
    with sim_engine(model, ["sim:a:prefill=2000,decode=2000"], worker_kw=kw, trace_dir=str(tmp_path)) as engine:
        doc = doc_ids(150)
        handles = [engine.submit(prompt_ids=doc + [i], params=SamplingParams(max_tokens=2)) for i in range(3)]
        for h in handles:
            h.result(20)
        engine.generate(prompt_ids=doc_ids(200, seed=9), params=SamplingParams(max_tokens=2))  # evicts
        path = engine.export_trace()
    import json
    events = json.load(open(path))["traceEvents"]
    instants = {e["name"]: e for e in events if e["ph"] == "i"}
    assert {"publish", "hit", "evict", "follow"} <= set(instants)
    assert instants["hit"]["args"]["tokens"] == 144
    route = [e for e in events if e["ph"] == "i" and e["name"] == "route"]
    assert all("reuse" in e["args"] for e in route)        # each candidate's estimate
    phases = [e["name"] for e in sorted((e for e in events if e["ph"] == "X"), key=lambda e: e["ts"])
              if e.get("args", {}).get("request") == handles[1].id]
    assert phases[:3] == ["queued", "waiting-on-leader", "prefill"], phases


def test_contiguous_kv_has_no_prefix_cache(model):
    """A contiguous region per sequence cannot share pages: the worker says the cache is off."""
    with sim_engine(model, [f"sim:a:{FAST}"], worker_kw={"kv_cache": "contiguous"}) as engine:
        doc = doc_ids(100)
        engine.submit(prompt_ids=doc + [5], params=SamplingParams(max_tokens=2)).result(10)
        r = engine.submit(prompt_ids=doc + [6], params=SamplingParams(max_tokens=2)).result(10)
        assert r.metrics.cached_tokens == 0
        assert not engine.snapshot().workers[0].prefix_cache
