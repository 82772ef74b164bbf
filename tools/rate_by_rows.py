"""How fast every linear layer of a decode step runs per row count, and what that allows
`bench batching`'s N8/N1 to reach on this CPU.

Every linear layer of the model runs once back to back (tools/kernel_bench.py's `time_set`, the
op's default kernel for each row count, 2 threads), for M = 1, 8, 16, 32, 64, 128, 256 rows,
the row counts in a rotated order each round and the median of the rounds quoted; prints ms and
GMAC/s. Then an estimate: an 8-row call does 8x a 1-row call's multiply-adds, so if it ran at
the best rate measured at any row count (where the weights' unpacking is spread over the most
rows), the 8-row linear layers would take 8 * MACs / best_rate; that over the 1-row time is the
8-row / 1-row ratio 8-row calls as efficient as the largest ones would give. N8/N1 >= 4 needs the
whole 8-row step at about twice the 1-row one (bench batching's aggregates: docs/benchmarks.md).
Last, per layer group, the part of an 8-row call that does not grow with the rows (its 8-row time
less the 8 rows more that a 16-row call costs): the tile build, the weight stream, the
activations' quantization; what a cheaper build could save at most. (The Q8_0 lm_head runs the
row lanes at 8 rows and the tiles at 16, so its split says nothing.)
  python tools/rate_by_rows.py [model] [rounds]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_bench import macs, time_set  # noqa: E402

from engine import kernels  # noqa: E402
from engine.cpuinfo import cpu_info, cpu_summary  # noqa: E402
from engine.models.catalog import resolve_model  # noqa: E402
from engine.models.decoder import Decoder  # noqa: E402
from engine.models.gguf import load_gguf  # noqa: E402
from engine.models.quant import LinearPolicy, QuantLinear  # noqa: E402
from engine.stats import median  # noqa: E402

ROWS = (1, 8, 16, 32, 64, 128, 256)


def main() -> None:
    model_name = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-0.5b"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    torch.set_num_threads(2)
    model = Decoder.from_gguf(load_gguf(str(resolve_model(model_name))), LinearPolicy())
    layers = [m for m in model.modules() if isinstance(m, QuantLinear) and m.gguf is not None]
    print(f"{model_name}, {cpu_summary()}, family/model {cpu_info()['family']}, kernels {kernels.isa_name()}, "
          f"2 threads, {rounds} rounds")
    times: dict[int, list[float]] = {m: [] for m in ROWS}
    for r in range(rounds):
        order = ROWS[r % len(ROWS):] + ROWS[:r % len(ROWS)]
        for m in order:
            times[m].append(time_set(layers, m, -1, reps=5 if m <= 32 else 3, big_m=-1))
    rate = {}
    for m in ROWS:
        ms = median(times[m])
        rate[m] = macs(layers, m) / ms / 1e6
        print(f"M={m:4d}  {ms:8.2f} ms  {rate[m]:6.1f} GMAC/s  ({ms / median(times[1]):5.2f}x the 1-row time)")
    best = max(rate, key=rate.get)
    t1, t8 = median(times[1]), median(times[8])
    t8_best = macs(layers, 8) / rate[best] / 1e6
    print(f"8 rows: {t8:.2f} ms = {t8 / t1:.2f}x the 1-row {t1:.2f} ms; at the best rate ({rate[best]:.1f} GMAC/s, "
          f"M={best}) they would take {t8_best:.2f} ms = {t8_best / t1:.2f}x")
    fixed_all = 0.0
    for op in sorted({m.op for m in layers}):
        group = [m for m in layers if m.op == op]
        t8s, more = [], []
        for r in range(max(rounds, 5)):
            pair = {}
            for m in ((8, 16) if r % 2 == 0 else (16, 8)):
                pair[m] = time_set(group, m, -1, reps=5, big_m=-1)
            t8s.append(pair[8])
            more.append(pair[16] - pair[8])
        g8, fixed = median(t8s), median(t8s) - median(more)
        if op != "lm-head":
            fixed_all += fixed
        print(f"{op:17s} 8 rows {g8:6.2f} ms, 8 rows more {median(more):6.2f}, not growing with the rows "
              f"{fixed:5.2f} ({fixed / g8:.0%})")
    print(f"not growing with the rows, all groups but the lm_head: {fixed_all:.2f} ms")


if __name__ == "__main__":
    main()
