"""Where the 0.5B's decode step goes at 1 and 8 rows: the model's forward over paged K/V
(tools/paged_step_ab.py's batch, 150-token contexts) against every linear layer timed alone
(tools/kernel_bench.py's time_set), alternating 5 times in one process; prints the medians and
the rest of the step (forward minus linear layers). TOKENTOP_KERNEL_ISA / TOKENTOP_AVX_VNNI pass
through, e.g. to time the AVX2 builds on an AVX-512 CPU:
  TOKENTOP_KERNEL_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 python tools/step_split.py
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_bench import time_set  # noqa: E402
from paged_step_ab import SPAN, decode_batch  # noqa: E402

from engine.models.catalog import resolve_model  # noqa: E402
from engine.models.decoder import Decoder  # noqa: E402
from engine.models.gguf import load_gguf  # noqa: E402
from engine.models.quant import LinearPolicy, QuantLinear  # noqa: E402
from engine.stats import median  # noqa: E402

ROWS = (1, 8)


def main() -> None:
    torch.set_num_threads(2)
    model = Decoder.from_gguf(load_gguf(str(resolve_model("qwen2.5-coder-0.5b"))), LinearPolicy())
    layers = [m for m in model.modules() if isinstance(m, QuantLinear) and m.gguf is not None]
    kv = model.new_kv_store(16 * SPAN)
    batches = {r: decode_batch(r, True) for r in ROWS}
    for b in batches.values():
        for _ in range(3):
            model.forward(b, kv)
    fwd: dict[int, list[float]] = {r: [] for r in ROWS}
    lin: dict[int, list[float]] = {r: [] for r in ROWS}
    for _ in range(5):
        for r in ROWS:
            times = []
            for _ in range(9):
                t0 = time.perf_counter()
                model.forward(batches[r], kv)
                times.append(time.perf_counter() - t0)
            fwd[r].append(median(times) * 1e3)
            lin[r].append(time_set(layers, r, -1, reps=9, big_m=-1))
    for r in ROWS:
        rest = median([f - x for f, x in zip(fwd[r], lin[r])])
        print(f"{r} rows: forward {median(fwd[r]):.2f} ms, linear layers {median(lin[r]):.2f} ms, rest {rest:.2f} ms")


if __name__ == "__main__":
    main()
