"""Prefill and decode speed with fp32 / fp16 / bf16 K/V stores, side by side in one process.

One model (the production policy: GGUF kernels), one store per dtype; each round runs, for
every dtype in turn, a 500-token prefill and then 32 decode steps at that context, and again
after growing the context to 2,000 tokens (prefill in 500-token chunks, as the engine does).
Medians over the rounds. Prints one JSON object.

    PYTHONPATH=. python tools/kv_dtype_speed.py [MODEL] [ROUNDS]
"""
from __future__ import annotations

import json
import sys
import time

import torch

from engine.bench import machine
from engine.models.batch import KV_TORCH_DTYPES, ForwardBatch, SeqSlice
from engine.models.catalog import resolve_model
from engine.models.decoder import Decoder
from engine.models.gguf import load_gguf
from engine.models.quant import LinearPolicy
from engine.worker.runner import pick_activation_dtype
from engine.stats import median

CHUNK, DECODE = 500, 32


def run(model: Decoder, kv, ids: list[int], context: int) -> tuple[float, float]:
    """Prefill `context` tokens (500-token chunks; tok/s of the last chunk), then DECODE steps."""
    slots = torch.arange(context + DECODE)
    prefill_s = 0.0
    for start in range(0, context, CHUNK):
        n = min(CHUNK, context - start)
        batch = ForwardBatch(torch.tensor(ids[start:start + n]), torch.arange(start, start + n),
                             slots[start:start + n], [SeqSlice(0, n, start + n, slots[:start + n])],
                             torch.tensor([n - 1]))
        t0 = time.perf_counter()
        model(batch, kv)
        prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(DECODE):
        p = context + i
        model(ForwardBatch(torch.tensor([ids[p % len(ids)]]), torch.tensor([p]), slots[p:p + 1],
                           [SeqSlice(0, 1, p + 1, slots[:p + 1])], torch.tensor([0])), kv)
    return n / prefill_s, DECODE / (time.perf_counter() - t0)


def main(name: str, rounds: int) -> None:
    torch.set_num_threads(2)
    model = Decoder.from_gguf(load_gguf(resolve_model(name)),
                              LinearPolicy(activation_dtype=pick_activation_dtype("cpu", "auto")))
    ids = torch.randint(100, 20000, (4096,), generator=torch.Generator().manual_seed(0)).tolist()
    stores = {d: model.new_kv_store(2048 + DECODE, dtype=KV_TORCH_DTYPES[d]) for d in ("fp32", "fp16", "bf16")}
    res = {d: {c: ([], []) for c in (500, 2000)} for d in stores}
    with torch.inference_mode():
        run(model, stores["fp32"], ids, 500)                      # warm-up
        for _ in range(rounds):
            for context in (500, 2000):
                for d, kv in stores.items():
                    p, dec = run(model, kv, ids, context)
                    res[d][context][0].append(p)
                    res[d][context][1].append(dec)
    out = {"model": name, "rounds": rounds, "machine": machine(), "threads": 2, "results": {}}
    for d in stores:
        for c in (500, 2000):
            p, dec = res[d][c]
            out["results"][f"{d} context {c}"] = {
                "prefill_last_chunk_tok_s": round(median(p), 1), "decode_tok_s": round(median(dec), 2),
                "prefill_over_fp32": round(median(p) / median(res["fp32"][c][0]), 3),
                "decode_over_fp32": round(median(dec) / median(res["fp32"][c][1]), 3)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-0.5b", int(sys.argv[2]) if len(sys.argv) > 2 else 3)
