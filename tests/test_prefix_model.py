"""Prefix reuse with a real forward pass: attention reads shared pages through the block
table, and greedy output with the cache on is identical to the cache off (deterministic)."""
import random
import time

import pytest

from engine.config import EngineConfig, SamplingParams, WorkerConfig
from engine.facade.engine import Engine


def start(model, **worker):
    cfg = WorkerConfig(**{"model": str(model), "threads": 1, "calibrate": False, **worker})
    return Engine(EngineConfig(workers=(cfg,), worker_mode="thread")).start(timeout=300)


def prompts_sharing(doc_len=150, n=5, seed=0, vocab=(5, 250)):
    rng = random.Random(seed)
    doc = [rng.randrange(*vocab) for _ in range(doc_len)]
    return [doc + [rng.randrange(*vocab) for _ in range(rng.randrange(1, 30))] for _ in range(n)] + [doc]


def run(engine, prompts, params, concurrent):
    if concurrent:
        handles = [engine.submit(prompt_ids=p, params=params) for p in prompts]
        return [h.result(120) for h in handles]
    return [engine.generate(prompt_ids=p, params=params) for p in prompts]


def settled(engine, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        w = engine.snapshot().workers[0]
        if w.pages_used == 0 and w.running == 0 and w.waiting == 0:
            return w
        time.sleep(0.05)
    raise AssertionError("pages not returned")


@pytest.mark.parametrize("single_flight", ["after-prefill", "off"])
def test_cache_on_equals_cache_off_greedy(tiny_model_path, single_flight):
    model = tiny_model_path("qwen2")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = prompts_sharing()
    with start(model, deterministic=True, prefix_cache="off") as engine:
        want = [r.token_ids for r in run(engine, prompts, params, concurrent=False)]
    with start(model, deterministic=True, single_flight=single_flight) as engine:
        seq = run(engine, prompts, params, concurrent=False)
        conc = run(engine, prompts[::-1], params, concurrent=True)
        assert [r.token_ids for r in seq] == want
        assert [r.token_ids for r in conc] == want[::-1]
        assert sum(r.metrics.cached_tokens for r in seq) >= 128 * (len(prompts) - 1)
        assert all(r.metrics.cached_tokens > 0 for r in conc)
        settled(engine)


def test_output_pages_are_reused_and_match(tiny_model_path):
    """A follow-up turn (prompt + answer + more) restores the answer's decode pages too."""
    model = tiny_model_path("qwen2")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    first = prompts_sharing(doc_len=40, n=1)[0]
    with start(model) as engine:
        a = engine.generate(prompt_ids=first, params=params)
        turn = first + a.token_ids + [7, 8, 9]
        b = engine.generate(prompt_ids=turn, params=SamplingParams(max_tokens=4, ignore_eos=True))
        assert b.metrics.cached_tokens >= (len(first) + 32) // 16 * 16
    with start(model, prefix_cache="off") as engine:
        c = engine.generate(prompt_ids=turn, params=SamplingParams(max_tokens=4, ignore_eos=True))
    assert b.token_ids == c.token_ids


def test_stress_on_a_real_forward_with_a_small_pool(tiny_model_path):
    model = tiny_model_path("qwen2")
    rng = random.Random(3)
    prompts = prompts_sharing(doc_len=60, n=30, seed=1) + prompts_sharing(doc_len=90, n=30, seed=2)
    rng.shuffle(prompts)
    from tests.test_prefix_engine import slot_bytes
    memory = 40 * 16 * slot_bytes(model)
    with start(model, kv_cache_memory=memory, max_active=6, max_batched_tokens=64) as engine:
        w0 = engine.snapshot().workers[0]
        assert w0.pages_total < 60
        handles = []
        for p in prompts:
            handles.append(engine.submit(prompt_ids=p, params=SamplingParams(max_tokens=rng.randrange(1, 30))))
            if rng.random() < 0.15:
                rng.choice(handles).abort()
        results = [h.result(300) for h in handles]
        assert {r.finish_reason for r in results} <= {"length", "abort", "stop"}
        w = settled(engine)
        assert w.prefix["prefix_cache_hits"] > 0 and w.prefix["waiting_on_leader"] == 0


@pytest.mark.realmodel
def test_real_model_cache_on_equals_off_deterministic(real_model_path):
    """Qwen2.5-Coder-0.5B, greedy, --deterministic: the same tokens with the cache on or off,
    for a shared document with different questions served together and a warm repeat."""
    doc = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
           "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n") * 4
    questions = ["# Explain what this code does:\n", "# Write a test for fibonacci:\n",
                 "# Rewrite it recursively:\n"]
    params = SamplingParams(max_tokens=16)
    with start(real_model_path, threads=2, deterministic=True, prefix_cache="off") as engine:
        want = [engine.generate(doc + q, params=params).token_ids for q in questions]
    with start(real_model_path, threads=2, deterministic=True) as engine:
        handles = [engine.submit(doc + q, params=params) for q in questions]
        got = [h.result(300) for h in handles]
        warm = engine.generate(doc + questions[0], params=params)
    assert [r.token_ids for r in got] == want
    assert warm.token_ids == want[0]
    assert all(r.metrics.cached_tokens >= 64 for r in got[1:]) and warm.metrics.cached_tokens >= 64


def test_followers_joining_the_leaders_step_read_its_pages_exactly(tiny_model_path):
    """A cold burst (single flight after-prefill, --deterministic): followers are scheduled in
    the very step in which their leader computes the pages they wait for, and their attention
    reads those pages through the block table in that step; greedy output is still the same
    as with the cache off. Identical prompts and a shared document with own endings."""
    model = tiny_model_path("qwen2")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = prompts_sharing(doc_len=200, n=4, seed=5)
    prompts = prompts + [prompts[0]] * 3
    with start(model, deterministic=True, prefix_cache="off") as engine:
        want = [r.token_ids for r in run(engine, prompts, params, concurrent=False)]
    with start(model, deterministic=True, single_flight="after-prefill") as engine:
        got = run(engine, prompts, params, concurrent=True)
        w = settled(engine)
    assert [r.token_ids for r in got] == want
    assert w.prefix["single_flight_joins"] > 0
    assert sorted(r.metrics.cached_tokens for r in got)[-1] >= 192
