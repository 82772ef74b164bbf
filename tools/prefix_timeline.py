"""Per-step timeline of `tokentop bench prefix`'s N = 8 bursts (same prompts, same worker
settings: 0.5B, 2 threads, budget 512, max 8 active), one engine per mode: for each step its
wall time, the scheduling time, and which requests computed how many tokens. TR=DIR also
writes each engine's trace there (per-layer attention / matmul times).

    flock /tmp/tokentop-cpu.lock env PYTHONPATH=. python tools/prefix_timeline.py --out 128
"""
import argparse
import os
import time

import engine.bench.scenarios as SC
import engine.worker.loop as W
from engine.bench import prefix as P
from engine.bench.scenarios import base_worker, start_engine, stop_engine
from engine.config import SamplingParams

if os.environ.get("TR"):
    SC.TRACE_DIR = os.environ["TR"]

LOG = []
orig = W.Worker._step
def _step(self, tracer):
    t0 = time.monotonic()
    plan_box = {}
    osched = self.scheduler.schedule
    def sched():
        p = osched(); plan_box['p'] = p; plan_box['ts'] = time.monotonic(); return p
    self.scheduler.schedule = sched
    try:
        orig(self, tracer)
    finally:
        self.scheduler.schedule = osched
    t1 = time.monotonic()
    p = plan_box.get('p')
    if p is not None:
        LOG.append((t0, plan_box['ts'] - t0, t1 - t0,
                    [(i.seq.id[-3:], i.num_tokens, i.samples) for i in p.items],
                    len(self.scheduler.waiting)))
W.Worker._step = _step

ap = argparse.ArgumentParser()
ap.add_argument("--modes", default="independent,incremental,after-prefill")
ap.add_argument("--which", default="id,pp")
ap.add_argument("--out", type=int, default=128)
ap.add_argument("--mbt", type=int, default=512)
a = ap.parse_args()

class Args:  # base_worker args
    model = "qwen2.5-coder-0.5b"; threads = 2; max_active = 8; max_batched_tokens = a.mbt; page_size = 16
    kv_cache_memory = "256MiB"; kv_cache = "paged"; deterministic = False; activation_dtype = "auto"
    weights = "faithful"; device = None

for mode in a.modes.split(","):
    eng = start_engine([base_worker(Args, max_active=8, **P.MODES[mode])])
    try:
        P._burst(eng, [P.text_ids(eng, 40, "warm up")], 4, "warmup")
        shared = P.text_ids(eng, 532, "Shared prompt:")
        doc = P.text_ids(eng, 800, "Design document:")
        qs = [eng.tokenizer.encode("\n" + q, add_special=False) for q in P.QUESTIONS]
        for which in a.which.split(","):
            prompts = [shared] * 8 if which == "id" else [doc + qs[i] for i in range(8)]
            params = SamplingParams(max_tokens=a.out, ignore_eos=True, cache_salt=f"{which}-{mode}")
            LOG.clear()
            t0 = time.monotonic()
            hs = [eng.submit(prompt_ids=p, params=params) for p in prompts]
            rs = [h.result() for h in hs]
            ttfts = [r.metrics.ttft for r in rs]
            print(f"== {mode} {which}: mean TTFT {sum(ttfts)/8:.3f} ttfts {[round(x,3) for x in ttfts]} slowest {max(r.metrics.e2e for r in rs):.2f} cached {[r.metrics.cached_tokens for r in rs]}")
            first_tok = sorted(ttfts)
            for (ts, sch, dur, items, nw) in LOG[:14]:
                pre = [(s, n) for s, n, smp in items if n > 1 or not smp]
                ndec = sum(1 for s, n, smp in items if n == 1 and smp)
                print(f"  t={ts-t0:6.3f} step {dur*1000:7.1f} ms (sched {sch*1000:5.1f}) tok={sum(n for _,n,_ in items):4d} prefill={pre} dec={ndec} waiting={nw}")
            steps = [d for _, _, d, items, _ in LOG if all(n == 1 for _, n, _ in items)]
            if steps:
                steps.sort(); print(f"  decode-only steps: {len(steps)} median {steps[len(steps)//2]*1000:.1f} ms")
    finally:
        stop_engine(eng)
