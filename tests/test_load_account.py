"""The router's load account (engine/facade/requests.py RequestTable.loads) is kept up to date as
requests are routed, progress, get rerouted, preempted, finish, are aborted or die with their
worker. After every step of a random run through the engine's own submit and dispatcher, it
must equal a count made from scratch over every request record, as loads() used to make it."""
from __future__ import annotations

import queue
import random
from dataclasses import replace

import pytest

from engine import messages as msg
from engine.config import EngineConfig, SamplingParams, WorkerConfig
from engine.facade.engine import Engine
from engine.facade.requests import KEEP_FINISHED
from engine.facade.router import NOMINAL_RATES, WorkerLoad
from engine.facade.snapshot import RequestState
from engine.facade.workers import WorkerSlot, WorkerState
from engine.kv.prefix_cache import DELTA_KEY_BYTES, chain_keys, extra_key
from engine.models.tokenizer import Tokenizer

N_WORKERS = 5
REMOTE = 4            # this slot forwards to a server that also serves other clients


def recounted(table, workers) -> list[WorkerLoad]:
    """The load of every worker counted from every record (the account before it was kept)."""
    loads = {}
    for w in workers:
        pre, dec = w.profile
        loads[w.index] = WorkerLoad(w.index, w.info_or_config().name, pre or NOMINAL_RATES[0],
                                    dec or NOMINAL_RATES[1], alive=w.ready, nominal=not (pre and dec))
    for rec in table.records.values():
        if rec.finish_reason is not None or rec.worker is None:
            continue
        load = loads[rec.worker]
        if rec.state == RequestState.QUEUED:
            load.waiting += 1
        else:
            load.running += 1
        load.prefill_tokens += max(0, rec.prompt_len_on(rec.worker) - max(rec.computed, rec.cached_estimate))
        load.decode_tokens += max(0, rec.params.max_tokens - len(rec.output_ids))
    external = {w.index: w.stats.external_requests for w in workers
                if w.cfg.remote and w.stats is not None and w.stats.external_requests}
    if external:
        recs = list(table.records.values())
        prompt = sum(len(r.prompt_ids) for r in recs) / len(recs) if recs else 0.0
        decode = sum(r.params.max_tokens for r in recs) / len(recs) if recs else 0.0
        for ld in loads.values():
            n = external.get(ld.worker, 0)
            if n:
                ld.waiting += n
                ld.prefill_tokens += round(n * prompt)
                ld.decode_tokens += round(n * decode)
    return list(loads.values())


def _engine(tokenizer: Tokenizer) -> Engine:
    """An engine that is never started: its slots look ready, as WorkerReady would make them."""
    base = WorkerConfig(model="m", device="sim:w", sim_prefill_tps=2000.0, sim_decode_tps=200.0,
                        calibrate=False, page_size=4)
    configs = [replace(base, device=f"sim:w{i}", name=f"w{i}") for i in range(N_WORKERS - 1)]
    configs.append(replace(base, device="remote:http://127.0.0.1:9", name="far"))
    engine = Engine(EngineConfig(workers=tuple(configs), worker_mode="thread"))
    for i, cfg in enumerate(configs):
        info = msg.WorkerInfo(name=cfg.name, model=cfg.model, device=cfg.device, pages=512,
                              page_size=cfg.page_size, max_context=256, max_active=8, prefix_cache="on")
        engine.workers.slots.append(WorkerSlot(i, cfg, queue.Queue(), state=WorkerState.READY, info=info,
                                               profile=(0.0, 0.0) if i == 1 else (1000.0 + i, 100.0 + i)))
    engine.workers.events = queue.Queue()
    engine.tokenizer = tokenizer
    return engine


def _stats(worker: int, seqs=(), external: int = 0) -> msg.WorkerStats:
    return msg.WorkerStats(worker, 0, 0, 512, 0, b"", 0.0, 0.0, 0, 0, "fcfs", seqs=tuple(seqs),
                           external_requests=external)


def _metrics(rec) -> msg.RequestMetrics:
    return msg.RequestMetrics(len(rec.prompt_ids), 0, len(rec.output_ids), None, None, None, None, 1.0)


@pytest.mark.parametrize("seed", range(3))
def test_the_running_account_equals_a_recount_after_every_step(tiny_model_path, seed):
    rng = random.Random(seed)
    tokenizer = Tokenizer.from_gguf(tiny_model_path("qwen2"))
    engine = _engine(tokenizer)
    table, d = engine.requests, engine.dispatcher
    ident_extra = extra_key(engine.workers[0].cache_ident, None)
    seen_ops, submitted, published, reused = set(), [], [], 0

    def live_on(worker=None):
        return [r for r in table.records.values()
                if r.finish_reason is None and (worker is None or r.worker == worker)]

    ops = ["submit"] * 4 + ["stats", "tokens", "tokens", "finish", "reroute", "die", "publish",
                            "external", "profile"]
    for step in range(900):
        op = rng.choice(ops)
        ready = engine.workers.ready()
        if op == "submit" and ready:
            ids = [rng.randrange(3, tokenizer.vocab_size) for _ in range(rng.randrange(1, 60))]
            if published and rng.random() < 0.5:   # a prompt that starts with published pages
                ids = rng.choice(published)[:rng.randrange(1, 60)] + ids
            lengths = {REMOTE: (len(ids) + rng.randrange(-3, 9), "remote")} if rng.random() < 0.5 else {}
            force = rng.choice(ready).index if rng.random() < 0.2 else None
            submitted.append(ids)
            handle = engine.submit(prompt_ids=ids, params=SamplingParams(max_tokens=rng.randrange(1, 80)),
                                   worker=force, prompt_lengths=lengths)
            reused += table.get(handle.id).cached_estimate > 0
        elif op == "publish" and ready:   # a worker publishes pages: later prompts route with a discount
            w = rng.choice(ready)
            ids = rng.choice(submitted) if submitted else [5] * 12
            published.append(ids)
            keys = chain_keys(ids, w.info.page_size, ident_extra)
            n = rng.randrange(0, len(keys) + 1)
            d.apply(msg.StepEvents(w.index, (), (), cache_delta=tuple((True, k[:DELTA_KEY_BYTES])
                                                                       for k in keys[:n])))
        elif op == "stats" and ready:     # running, waiting again (preempted: computed back to 0)
            w = rng.choice(ready)
            seqs = []
            for rec in live_on(w.index):
                if rng.random() < 0.7:
                    state = rng.choice(["waiting", "prefill", "decode"])
                    computed = 0 if state == "waiting" else rng.randrange(0, len(rec.prompt_ids) + 1)
                    seqs.append(msg.SeqView(rec.id, state, len(rec.prompt_ids), rng.randrange(0, 8),
                                            computed, len(rec.output_ids), rec.params.max_tokens))
            d.apply(_stats(w.index, seqs))
            if seqs and any(s.state == "waiting" for s in seqs):
                d.apply(msg.StepEvents(w.index, (), (), preempted=tuple(s.request_id for s in seqs
                                                                         if s.state == "waiting")))
        elif op == "tokens":
            recs = live_on()
            if recs:
                rec = rng.choice(recs)
                deltas = tuple(msg.TokenDelta(rec.id, rng.randrange(3, 50), "x")
                               for _ in range(rng.randrange(1, 6)))
                d.apply(msg.StepEvents(rec.worker, deltas, ()))
        elif op == "finish":
            recs = live_on()
            if recs:
                rec = rng.choice(recs)
                reason = rng.choice(["stop", "length", "abort", "error"])
                d.apply(msg.StepEvents(rec.worker, (), (msg.Finished(rec.id, reason, None, _metrics(rec)),)))
        elif op == "reroute":             # refused before streaming: goes elsewhere, or fails
            recs = live_on()
            if recs:
                rec = rng.choice(recs)
                d.apply(msg.Reroute(rec.worker, rec.id, "503 from the server"))
        elif op == "die" and len(ready) > 1:
            w = rng.choice(ready)
            d.apply(msg.WorkerDead(w.index, "killed"))
            assert not live_on(w.index)
            w.state = WorkerState.READY        # as a respawned worker comes back, empty
        elif op == "external":            # the remote's scrape: requests from its other clients
            d.apply(_stats(REMOTE, external=rng.randrange(0, 4)))
        elif op == "profile" and ready:
            engine.set_worker_profile(rng.choice(ready).index, rng.uniform(50, 3000), rng.uniform(5, 300))
        seen_ops.add(op)
        assert engine.loads() == recounted(table, engine.workers), f"step {step} ({op})"
    assert seen_ops == set(ops)
    logged = [line.text for line in engine.event_log.lines()]
    assert any("rerouted" in t for t in logged) and any("died" in t for t in logged)
    assert len(submitted) > len(table.records) >= KEEP_FINISHED   # old records were dropped on the way
    assert reused >= 5                 # requests routed with a prefix discount
