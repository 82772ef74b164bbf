"""The model's decode step over paged K/V against contiguous K/V, in one process.

R decode rows of 150 tokens each: "paged" gives each sequence 16-slot pages handed out
round-robin (as R sequences growing together get them from the pool), "contiguous" one range of
slots per sequence. 15 interleaved pairs (ABBA); prints the median times and the median of the
pairs' speed ratios. The engine-level comparison is `tokentop bench batching`'s paged/contiguous
pair; this isolates the forward from the two engines' processes.
  python tools/paged_step_ab.py 8
"""
from __future__ import annotations

import sys
import time

import torch

from engine.models.batch import ForwardBatch, SeqSlice
from engine.models.catalog import resolve_model
from engine.models.decoder import Decoder
from engine.models.gguf import load_gguf
from engine.models.quant import LinearPolicy
from engine.stats import median

CONTEXT, PAGE, SPAN = 150, 16, 1024


def decode_batch(rows: int, paged: bool) -> ForwardBatch:
    seqs, writes = [], []
    for i in range(rows):
        if paged:
            pages = torch.tensor([p * rows + i for p in range(-(-CONTEXT // PAGE))])
            slots = (pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)[:CONTEXT]
            start = None
        else:
            slots, start = torch.arange(i * SPAN, i * SPAN + CONTEXT), i * SPAN
        seqs.append(SeqSlice(i, 1, CONTEXT, slots, start))
        writes.append(int(slots[-1]))
    return ForwardBatch(torch.randint(0, 1000, (rows,)), torch.full((rows,), CONTEXT - 1),
                        torch.tensor(writes), seqs, torch.arange(rows))


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    torch.set_num_threads(2)
    model = Decoder.from_gguf(load_gguf(str(resolve_model("qwen2.5-coder-0.5b"))), LinearPolicy())
    kv = model.new_kv_store(max(16, rows) * SPAN)
    sides = {"paged": decode_batch(rows, True), "contiguous": decode_batch(rows, False)}
    for b in sides.values():
        model.forward(b, kv)
        model.forward(b, kv)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(15):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            t0 = time.perf_counter()
            model.forward(sides[name], kv)
            times[name].append(time.perf_counter() - t0)
    ratio = median([c / p for p, c in zip(times["paged"], times["contiguous"])])
    print(f"{rows} rows: paged {median(times['paged']) * 1e3:.1f} ms, contiguous "
          f"{median(times['contiguous']) * 1e3:.1f} ms, paged speed / contiguous {ratio:.3f}")


if __name__ == "__main__":
    main()
