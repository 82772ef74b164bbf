"""`tokentop bench router` (engine/bench/router_cost.py): its simulated fleet is the engine's own
account, so decisions over it are real ones; a tiny run only checks the report and the set-up
(figures from this shared machine would be noise)."""
from __future__ import annotations

import random
from types import SimpleNamespace

from engine.bench.router_cost import POLICIES, PROMPT_TOKENS, bench_router, fleet_engine
from engine.facade.router import reusable_prefix_tokens


def test_decisions_over_the_simulated_fleet_are_the_engines_own():
    rng = random.Random(1)
    prompt = [rng.randrange(10, 30_000) for _ in range(PROMPT_TOKENS)]
    engine = fleet_engine(16, 200, prompt)
    cached = reusable_prefix_tokens(prompt, None, engine.workers.ready())
    holders = {i: n for i, n in cached.items() if n}
    assert set(holders) == {0, 8}                  # one worker in eight holds the prompt's pages
    loads = engine.loads()
    assert sum(ld.running + ld.waiting for ld in loads) == 200
    engine.router.set_policy("cache-aware")
    d = engine.router.choose("x", len(prompt), 128, loads, cached=cached)
    if d.reason == "longest prefix":
        assert d.chosen == max(holders, key=holders.get)
    assert len(d.candidates) == 16


def test_a_tiny_run_reports_every_count_and_policy():
    report = bench_router(SimpleNamespace(sizes="4,8", quick=True, runs=1, queued=10))
    assert [(r["workers"], r["policy"]) for r in report["rows"]] == [(n, p) for n in (4, 8) for p in POLICIES]
    for r in report["rows"]:
        assert all(r[part]["median_us"] > 0 for part in ("loads", "reuse", "choose", "total"))
        assert r["meets_goal"] == (r["total"]["median_us"] <= 1000)
