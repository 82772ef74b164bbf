"""Request timelines (engine/facade/timeline.py): phases named as the trace's lifecycles, the
prefill chunks, preemptions, single-flight waits and speculative rounds, from a live engine."""
from __future__ import annotations

import random
from types import SimpleNamespace

from engine import messages as msg
from engine.config import EngineConfig, SamplingParams, WorkerConfig
from engine.facade.devices import parse_devices
from engine.facade.engine import Engine
from engine.facade.snapshot import RequestState
from engine.facade.timeline import ENDS, PHASES, Timeline, TimelineStore, build
from engine.trace import TERMINAL_PHASES
from tests.waiting import wait_until


def test_phase_names_are_the_lifecycles_and_states():
    lifecycle = {"queued", "waiting-on-leader", "prefill", "decode"}     # engine/trace.py's spans
    assert lifecycle <= set(PHASES) and set(PHASES) - lifecycle == {"preempted"}
    assert set(ENDS) == set(TERMINAL_PHASES) == {s.value for s in RequestState if not s.live}
    assert {s.value for s in RequestState if s.live} <= set(PHASES)


def record(**kw):
    base = dict(id="r1", arrival=10.0, follow_at=None, metrics=None, prefill_at=None, finish_reason=None,
                finished_at=None, spec=None)
    return SimpleNamespace(**{**base, **kw})


def test_a_timeline_from_what_the_dispatcher_saw():
    store = TimelineStore()
    rec = record()
    records = {"r1": rec}
    step = lambda t, **kw: store.on_step(msg.StepEvents(0, kw.get("tokens", ()), (), kw.get("preempted", ()),  # noqa: E731
                                                        prefilled=kw.get("prefilled", ())), t, records)
    token = msg.TokenDelta("r1", 5, "x")
    step(10.5, prefilled=(("r1", 64),))
    step(10.7, prefilled=(("r1", 30),), tokens=(token,))     # the last chunk samples the first token
    step(10.8, tokens=(token,))
    step(10.9, preempted=("r1",))
    step(11.2, prefilled=(("r1", 96),))
    step(11.3, tokens=(token,))
    rec.prefill_at = 10.6                 # the stats saw it running after its first chunk: not earlier
    t = store.timelines(records)["r1"]
    assert t.phases == (("queued", 10.0), ("prefill", 10.5), ("decode", 10.7), ("preempted", 10.9),
                        ("prefill", 11.2), ("decode", 11.3))
    assert [k for k, _ in t.ticks] == ["prefill", "prefill", "prefill"] and t.end is None
    assert [t.phase_at(x) for x in (9.0, 10.2, 10.6, 11.0, 11.25, 99.0)] == \
        [None, "queued", "prefill", "preempted", "prefill", "decode"]
    rec.spec = {"mode": "ngram"}
    step(11.4, tokens=(token,))
    assert store.timelines(records)["r1"].ticks[-1] == ("spec", 11.4)   # a verify round
    rec.finish_reason, rec.finished_at = "stop", 11.5
    rec.metrics = msg.RequestMetrics(94, 0, 3, 0.3, 0.7, 0.1, 0.1, 1.5)   # scheduled 0.3 s after arrival
    t = store.timelines(records)["r1"]
    assert t.phases[1] == ("prefill", 10.3) and t.end == ("finished", 11.5) and t.phase_at(12.0) is None
    step(11.6, tokens=(token,), preempted=("r1",))                        # after its end: not on it
    assert store.timelines(records)["r1"] == t
    assert store.timelines({}) == {} and store._events == {} and store._final == {}   # forgotten with it


def test_a_live_timeline_is_built_again_only_when_what_it_comes_from_changes():
    store = TimelineStore()
    rec = record()
    records = {"r1": rec}
    store.on_step(msg.StepEvents(0, (msg.TokenDelta("r1", 5, "x"),), (), (), prefilled=(("r1", 64),)), 10.5, records)
    first = store.timelines(records)["r1"]
    assert store.timelines(records)["r1"] is first      # a decoding request: nothing new to build
    rec.prefill_at = 10.2                                # the stats saw it scheduled before its first chunk
    assert store.timelines(records)["r1"].phases[1] == ("prefill", 10.2)
    assert store.timelines({}) == {} and store._built == {}


def test_a_follower_and_a_request_never_scheduled():
    follower = build(record(follow_at=10.2, prefill_at=10.9), (("decode", 11.0),), ())
    assert follower.phases == (("queued", 10.0), ("waiting-on-leader", 10.2), ("prefill", 10.9), ("decode", 11.0))
    aborted = build(record(finish_reason="abort", finished_at=10.4), (), ())
    assert aborted == Timeline((("queued", 10.0),), ("aborted", 10.4))


def sim(model, spec, **worker):
    base = WorkerConfig(model=str(model), **worker)
    return Engine(EngineConfig(workers=parse_devices([spec], base), worker_mode="thread")).start(120)


def test_chunks_preemptions_and_waits_on_a_live_engine(tiny_model_path):
    model = tiny_model_path("qwen2", context_length=2048)
    # 64 KV pages and long outputs: requests get preempted; 80-token steps: prompts in chunks
    with sim(model, "sim:a:prefill=2000,decode=2000", kv_cache_memory=64 * 8192, max_batched_tokens=80) as engine:
        rng = random.Random(3)
        handles = [engine.submit(prompt_ids=[rng.randrange(10, 200) for _ in range(200)],
                                 params=SamplingParams(max_tokens=300, ignore_eos=True)) for _ in range(4)]
        wait_until(lambda: any(ph == "preempted" for t in engine.snapshot().timelines.values()
                               for ph, _ in t.phases), 30, "a preemption on a timeline")
        for h in handles:
            h.result(60)
        snap = engine.snapshot()
    timelines = [snap.timelines[h.id] for h in handles]
    assert all(t.end is not None and t.end[0] == "finished" for t in timelines)
    for t in timelines:
        names = [p for p, _ in t.phases]
        assert set(names) <= set(PHASES) and names[0] == "queued" and names[-1] == "decode"
        assert [s for _, s in t.phases] == sorted(s for _, s in t.phases) and t.phases[-1][1] <= t.end[1]
        assert sum(k == "prefill" for k, _ in t.ticks) >= 3                    # 200 tokens in 80-token steps
    again = next(t for t in timelines if "preempted" in [p for p, _ in t.phases])
    names = [p for p, _ in again.phases]
    assert names[names.index("preempted") + 1] == "prefill"                    # it recomputes


def test_single_flight_followers_wait_on_their_timeline(tiny_model_path):
    model = tiny_model_path("qwen2")
    with sim(model, "sim:a:prefill=400,decode=2000", max_batched_tokens=80, max_active=4) as engine:
        doc = [random.Random(5).randrange(10, 200) for _ in range(200)]
        handles = [engine.submit(prompt_ids=doc, params=SamplingParams(max_tokens=3)) for _ in range(3)]
        for h in handles:
            h.result(30)
        snap = engine.snapshot()
    waited = [snap.timelines[h.id] for h in handles[1:]]
    assert all("waiting-on-leader" in [p for p, _ in t.phases] for t in waited)
    assert "waiting-on-leader" not in [p for p, _ in snap.timelines[handles[0].id].phases]


def test_speculative_rounds_are_ticks(tiny_model_path):
    model = tiny_model_path("qwen2")
    cfg = WorkerConfig(model=str(model), threads=1, calibrate=False, spec_k="4", speculate="ngram")
    with Engine(EngineConfig(workers=(cfg,), worker_mode="thread")).start(120) as engine:
        h = engine.submit("zebra " * 20, params=SamplingParams(max_tokens=30, ignore_eos=True))
        h.result(60)
        wait_until(lambda: engine.snapshot().timelines[h.id].end is not None, 5, "the end")
        t = engine.snapshot().timelines[h.id]
    rounds = [x for k, x in t.ticks if k == "spec"]
    assert rounds and all(s <= x <= t.end[1] for x in rounds for s in [t.phases[0][1]])
    assert len(rounds) <= 30
