"""Decode attention alone (`tokentop::decode_attention`), from a cold and a warm cache.

One query row (12 heads over 2 KV heads, head size 128: the 1.5B's shapes) over L keys, for each
store dtype. Cold: 28 layers' stores, each read once after a 64 MB read has flushed the caches,
as in a decode step (the step's weights stream through the caches between two visits of a
layer). Warm: one layer's store read 500 times. Medians, microseconds a layer.

    PYTHONPATH=. python tools/attention_bench.py [THREADS]
"""
from __future__ import annotations

import sys
import time

import torch

from engine import kernels
from engine.bench import machine
from engine.stats import median

H, KV, HD, LAYERS, SLOTS = 12, 2, 128, 28, 4096


def cold_us(q, stores, slots, lengths, rounds: int = 15) -> float:
    flush = torch.ones(16 << 20)
    times = []
    for _ in range(rounds):
        flush.sum()
        t0 = time.perf_counter()
        for k, v in stores:
            torch.ops.tokentop.decode_attention(q, k, v, slots, lengths, 0.0)
        times.append((time.perf_counter() - t0) / len(stores) * 1e6)
    return median(times)


def warm_us(q, k, v, slots, lengths, reps: int = 500) -> float:
    for _ in range(50):
        torch.ops.tokentop.decode_attention(q, k, v, slots, lengths, 0.0)
    t0 = time.perf_counter()
    for _ in range(reps):
        torch.ops.tokentop.decode_attention(q, k, v, slots, lengths, 0.0)
    return (time.perf_counter() - t0) / reps * 1e6


def main(threads: int) -> None:
    if not kernels.load():
        sys.exit("the C++ ops are unavailable: " + kernels.status()["reason"])
    torch.set_num_threads(threads)
    q = torch.randn(1, H, HD) / HD ** 0.5
    rows = []
    for L in (560, 2000):
        slots, lengths = torch.arange(L).view(1, L), torch.tensor([L])
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            stores = [(torch.randn(SLOTS, KV, HD).to(dtype), torch.randn(SLOTS, KV, HD).to(dtype))
                      for _ in range(LAYERS)]
            rows.append({"keys": L, "store": str(dtype).removeprefix("torch."),
                         "cold_us": round(cold_us(q, stores, slots, lengths), 1),
                         "warm_us": round(warm_us(q, *stores[0], slots, lengths), 1)})
            print(rows[-1], file=sys.stderr)
    import json
    print(json.dumps({"machine": machine(), "threads": threads, "heads": H, "kv_heads": KV,
                      "head_dim": HD, "results": rows}, indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
