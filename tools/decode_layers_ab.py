"""A/B of a decode step's layers in one C++ call (tokentop.DecodeLayers) against the per-layer
Python loop, same model, same process, alternating; checks that both give the same bits.

Forward only (no engine): a 100-token prefill, then 32 timed decode steps of `rows` sequences,
ms a step, each round's pair printed with a plain memory read (GB/s) for the bandwidth level.
Run under the CPU lock:
  flock /tmp/tokentop-cpu.lock python tools/decode_layers_ab.py qwen2.5-coder-1.5b [rows] [rounds]
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from engine.bench import read_bandwidth
from engine.models.batch import ForwardBatch, SeqSlice
from engine.models.catalog import resolve_model
from engine.models.decoder import Decoder
from engine.models.gguf import load_gguf
from engine.models.quant import LinearPolicy

CONTEXT, WARM, TIMED, SLOTS = 100, 5, 32, 700


def decode(model: Decoder, rows: int, one_call: bool) -> tuple[list[torch.Tensor], float]:
    """Logits of the first steps and ms a step, on a fresh KV store."""
    model._layers = None if one_call else False     # False: what _decode_layers caches when it cannot serve
    ids = torch.randint(100, 20000, (CONTEXT + WARM + TIMED,), generator=torch.Generator().manual_seed(0)).tolist()
    slots = torch.arange(rows * SLOTS).view(rows, SLOTS)
    kv = model.new_kv_store(rows * SLOTS)
    with torch.inference_mode():
        for b in range(rows):
            s = slots[b, :CONTEXT]
            model(ForwardBatch(torch.tensor(ids[:CONTEXT]), torch.arange(CONTEXT), s,
                               [SeqSlice(0, CONTEXT, CONTEXT, s)], torch.tensor([CONTEXT - 1])), kv)

        def step(i: int) -> ForwardBatch:
            p = CONTEXT + i
            return ForwardBatch(torch.tensor([ids[p]] * rows), torch.tensor([p] * rows), slots[:, p].contiguous(),
                                [SeqSlice(b, 1, p + 1, slots[b, :p + 1]) for b in range(rows)], torch.arange(rows))

        first = [model(step(i), kv) for i in range(WARM)]
        t0 = time.perf_counter()
        for i in range(WARM, WARM + TIMED):
            model(step(i), kv)
    return first, (time.perf_counter() - t0) / TIMED * 1000


def main() -> None:
    name = sys.argv[1]
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    torch.set_num_threads(2)
    model = Decoder.from_gguf(load_gguf(str(resolve_model(name))), LinearPolicy())
    ratios = []
    for r in range(rounds):
        fast, t_fast = decode(model, rows, True)
        ref, t_ref = decode(model, rows, False)
        same = all(torch.equal(a, b) for a, b in zip(fast, ref))
        ratios.append(t_ref / t_fast)
        print(f"round {r}: one call {t_fast:.2f} ms, per layer {t_ref:.2f} ms, {ratios[-1]:.3f}x, "
              f"same bits: {same}, read {read_bandwidth(1 << 28, 3):.0f} GB/s", flush=True)
        if not same:
            raise SystemExit("the one-call path gave different logits")
    print(f"median {statistics.median(ratios):.3f}x ({rows} rows, {name})")


if __name__ == "__main__":
    main()
