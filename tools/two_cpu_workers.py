"""Two CPU workers in processes, 8 requests x 64 tokens, round-robin: each worker on 2 threads
(every core of a 2-core machine, the old default) against the split default (--threads 0).
Run under the CPU lock: flock /tmp/tokentop-cpu.lock env PYTHONPATH=. python tools/two_cpu_workers.py"""
import sys
import time
sys.path.insert(0, ".")
from engine.config import EngineConfig, SamplingParams, WorkerConfig
from engine.facade.devices import parse_devices
from engine.facade.engine import Engine
from engine.bench.scenarios import prompt_of
def run(threads):
    workers = parse_devices(["cpu", "cpu"], WorkerConfig(threads=threads, calibrate=False))
    eng = Engine(EngineConfig(workers=workers, worker_mode="process", router_policy="round-robin")).start()
    try:
        walls = []
        for r in range(3):
            ps = [prompt_of(eng, 24, f"r{r} {threads} q{i}: ") for i in range(8)]
            t0 = time.perf_counter()
            hs = [eng.submit(prompt_ids=p, params=SamplingParams(max_tokens=64, ignore_eos=True)) for p in ps]
            [h.result() for h in hs]
            walls.append(time.perf_counter() - t0)
        return [w.threads for w in workers], sorted(walls)[1]
    finally:
        eng.shutdown()
if __name__ == "__main__":
    for t in (2, 0, 2, 0):   # the old default on 2 cores, then the split, twice
        th, wall = run(t)
        print(f"threads per worker {th}: 8x64 tokens in {wall:.2f} s = {8 * 64 / wall:.1f} tok/s", flush=True)
