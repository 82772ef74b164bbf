"""`tokentop bench router`: what one routing decision costs the facade, with many workers and a
deep queue. Goal: at most 1 ms per decision at 256 workers.

A decision is what Engine.submit does for each request under the facade's lock: every
worker's load from the request table's running account (RequestTable.loads, one entry per
worker, however many requests are queued), the reusable-prefix estimate per worker (the
prompt's page chain hashed once, each worker's published keys looked up until the first
miss), then Router.choose. All three are the engine's
own code, on an Engine that is never started: N ready simulated workers (their slots filled
as step events would fill them, each holding PUBLISHED_KEYS page keys, one in eight the
prompt's first pages) and --queued requests (default 1,000) spread over them. No worker
runs; only the facade's arithmetic is timed. Reported per worker count and policy: median and
p99 of each part and of the whole, in microseconds, over --runs x DECISIONS decisions.
"""
from __future__ import annotations

import os
import random
import time
from dataclasses import replace

from engine import messages as msg
from engine.config import EngineConfig, SamplingParams, WorkerConfig
from engine.facade.engine import Engine
from engine.facade.router import reusable_prefix_tokens
from engine.facade.workers import WorkerSlot, WorkerState
from engine.facade.requests import RequestHandle, RequestRecord
from engine.facade.snapshot import RequestState
from engine.stats import median, percentile

DEFAULT_WORKERS = (8, 64, 256)
DECISIONS = 200
PROMPT_TOKENS = 512
PUBLISHED_KEYS = 2_000
GOAL_MS = 1.0
POLICIES = ("cost", "cache-aware", "least-loaded")


def fleet_engine(n_workers: int, n_queued: int, prompt: list[int], seed: int = 0) -> Engine:
    """An Engine whose facade believes it has n_workers ready workers and n_queued requests."""
    from engine.kv.prefix_cache import DELTA_KEY_BYTES, chain_keys, extra_key, model_identity

    rng = random.Random(seed)
    base = WorkerConfig(model="bench", device="sim:w", sim_prefill_tps=2000.0, sim_decode_tps=200.0,
                        calibrate=False, page_size=16)
    configs = tuple(replace(base, device=f"sim:w{i}", name=f"w{i}") for i in range(n_workers))
    engine = Engine(EngineConfig(workers=configs, worker_mode="thread"))
    ident = model_identity(base.model, base.activation_dtype, True)
    prompt_keys = [k[:DELTA_KEY_BYTES] for k in chain_keys(prompt, base.page_size, extra_key(ident, None))]
    for i, cfg in enumerate(configs):
        info = msg.WorkerInfo(name=cfg.name, model=cfg.model, device=cfg.device, simulated=True,
                              pages=4096, page_size=cfg.page_size, max_context=4096, max_active=8,
                              prefix_cache="on")
        slot = WorkerSlot(i, cfg, commands=None, state=WorkerState.READY, info=info,
                           profile=(rng.uniform(1000, 3000), rng.uniform(100, 300)))
        slot.cache_keys = {rng.randbytes(DELTA_KEY_BYTES) for _ in range(PUBLISHED_KEYS)}
        if i % 8 == 0:           # some workers hold the prompt's first pages, a different number each
            slot.cache_keys.update(prompt_keys[: rng.randrange(1, len(prompt_keys) + 1)])
        engine.workers.slots.append(slot)
    now = time.monotonic()
    for j in range(n_queued):
        rec = RequestRecord(f"q{j}", [rng.randrange(10, 30_000) for _ in range(rng.randrange(16, 1024))],
                            SamplingParams(max_tokens=rng.randrange(16, 512)), now, worker=rng.randrange(n_workers))
        if rng.random() < 0.3:   # some already running: part of the prompt computed, tokens out
            rec.state, rec.computed = RequestState.DECODE, len(rec.prompt_ids)
            rec.output_ids = [1] * rng.randrange(0, rec.params.max_tokens)
        engine.requests.add(rec, RequestHandle(rec, lambda rid: None))
    engine.tokenizer = None
    return engine


def time_decisions(engine: Engine, prompt: list[int], policy: str, n: int) -> dict:
    """n decisions as submit makes them, timed part by part (microseconds)."""
    engine.router.set_policy(policy)
    parts: dict[str, list[float]] = {"loads": [], "reuse": [], "choose": [], "total": []}
    live = engine.workers.ready()
    for i in range(n):
        t0 = time.perf_counter()
        loads = engine.loads()
        t1 = time.perf_counter()
        cached = reusable_prefix_tokens(prompt, None, live)
        t2 = time.perf_counter()
        engine.router.choose(f"b{i}", len(prompt), 128, loads, cached=cached)
        t3 = time.perf_counter()
        for name, dt in (("loads", t1 - t0), ("reuse", t2 - t1), ("choose", t3 - t2), ("total", t3 - t0)):
            parts[name].append(dt * 1e6)
    return {name: {"median_us": round(median(v), 1), "p99_us": round(percentile(v, 99), 1)}
            for name, v in parts.items()}


def bench_router(args) -> dict:
    counts = [int(n) for n in args.sizes.split(",")] if args.sizes else list(DEFAULT_WORKERS)
    queued = 50 if args.quick else args.queued
    decisions = 20 if args.quick else DECISIONS
    runs = 1 if args.quick else args.runs
    rng = random.Random(1)
    prompt = [rng.randrange(10, 30_000) for _ in range(PROMPT_TOKENS)]
    rows = []
    for n in counts:
        engine = fleet_engine(n, queued, prompt)
        for policy in POLICIES:
            samples = [time_decisions(engine, prompt, policy, decisions) for _ in range(runs)]
            best = min(samples, key=lambda s: s["total"]["median_us"])   # the least disturbed run
            rows.append({"workers": n, "queued": queued, "policy": policy, **best,
                         "meets_goal": best["total"]["median_us"] <= GOAL_MS * 1000})
    return {"goal_ms_per_decision": GOAL_MS, "prompt_tokens": PROMPT_TOKENS,
            "published_keys_per_worker": PUBLISHED_KEYS, "decisions_per_run": decisions, "runs": runs,
            "cpu_load_1min": os.getloadavg()[0], "rows": rows}
