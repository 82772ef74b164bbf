"""Times tokentop::qmatmul's kernels on every linear layer of a real model's decode step."""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from engine import kernels
from engine.bench.common import read_bandwidth
from engine.models.catalog import resolve_model
from engine.models.decoder import Decoder
from engine.models.gguf import load_gguf
from engine.models.quant import LinearPolicy, QuantLinear
from engine.stats import median

USAGE = """\
For each row count M, every linear layer of the model runs once back to back, with the direct
kernels (small_m=16), the unpacked tiles (small_m=0) and the panels (big_m=1; AVX-512 only,
elsewhere the op's other kernels); prints the median time of the set, the GGUF bytes it reads
and the rate, then per GGUF type at M = 1. --prefill instead times many-row calls: the tiles
against the panels per row count and, at 512 rows, per layer shape, in GMAC/s.
--packed-ab times the default kernels with and without the packed K-quant copies (AVX-512).
Run on an otherwise idle machine:
  python tools/kernel_bench.py qwen2.5-coder-0.5b 2
tools/kernel_ab.py times the same set (time_set) across two checkouts.
"""


def time_set(layers: list[QuantLinear], m_rows: int, small_m: int, reps: int = 9, big_m: int = 0) -> float:
    """Median ms to run every layer once, back to back, on m_rows random activation rows."""
    xs = [torch.randn(m_rows, m.in_features) for m in layers]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for m, x in zip(layers, xs):
            kernels.qmatmul(x, m.gguf.tensors, m.gguf.types, m.gguf.rows, None, None, small_m, big_m)
        times.append(time.perf_counter() - t0)
    return median(times) * 1000


def macs(layers: list[QuantLinear], m_rows: int) -> int:
    return m_rows * sum(m.in_features * sum(m.gguf.rows) for m in layers)


def prefill(layers: list[QuantLinear]) -> None:
    """Tiles (small_m=0, big_m=0) against panels (big_m=1) for many-row calls."""
    for m_rows in (8, 12, 16, 24, 32, 64, 128, 512):
        reps = 5 if m_rows <= 64 else 3
        row = [f"M={m_rows:3d}"]
        for label, bm in (("tiles", 0), ("panels", 1)):
            ms = time_set(layers, m_rows, 0, reps, big_m=bm)
            row.append(f"{label} {ms:8.2f} ms {macs(layers, m_rows) / ms / 1e6:6.1f} GMAC/s")
        print("  ".join(row), flush=True)
    shapes = defaultdict(list)     # at 512 rows, per layer shape (types, rows, K)
    for m in layers:
        if m.op != "lm-head":
            shapes[(tuple(m.gguf.types), tuple(m.gguf.rows), m.in_features)].append(m)
    for key, sub in shapes.items():
        res = [time_set(sub, 512, 0, 3, big_m=bm) for bm in (0, 1)]
        print(f"types {key[0]} rows {key[1]} K {key[2]} x{len(sub)}: tiles {macs(sub, 512) / res[0] / 1e6:6.1f}"
              f"  panels {macs(sub, 512) / res[1] / 1e6:6.1f} GMAC/s", flush=True)


def packed_ab(layers: list[QuantLinear], rounds: int = 3) -> None:
    """The op's default kernels with the packed K-quant copies (TOKENTOP_PACKED=1) against
    without (0), alternated in this process (the op reads the variable per call), so a drift of
    the machine lands on both: the median of the pairs' ratios per row count."""
    import os

    from engine.models.quant import pack_for_batches

    for m in layers:
        pack_for_batches(m)
    sizes = (1, 2, 4, 8, 16, 32, 64)
    res = {(p, n): [] for p in "10" for n in sizes}
    for _ in range(rounds):
        for n in sizes:
            for p in "10":
                os.environ["TOKENTOP_PACKED"] = p
                res[(p, n)].append(time_set(layers, n, -1, reps=3, big_m=-1))
    os.environ.pop("TOKENTOP_PACKED")
    for n in sizes:
        ratios = [a / b for a, b in zip(res[("1", n)], res[("0", n)])]
        print(f"M={n:2d}  packed {median(res[('1', n)]):7.2f} ms  built {median(res[('0', n)]):7.2f} ms  "
              f"packed/built {median(ratios):.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, epilog=USAGE,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-0.5b", help="catalog name or .gguf path")
    ap.add_argument("threads", nargs="?", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--prefill", action="store_true", help="many-row calls: tiles against panels")
    ap.add_argument("--packed-ab", action="store_true",
                    help="the default kernels with the packed K-quant copies against without (AVX-512)")
    args = ap.parse_args()
    model_name = args.model
    torch.set_num_threads(args.threads)
    model = Decoder.from_gguf(load_gguf(str(resolve_model(model_name))), LinearPolicy())
    layers = [m for m in model.modules() if isinstance(m, QuantLinear) and m.gguf is not None]
    nbytes = sum(m.gguf.nbytes for m in layers)
    by_type = defaultdict(int)
    for m in layers:
        for t, w in zip(m.gguf.types, m.gguf.tensors):
            by_type[t] += w.numel()
    print(f"{model_name}: {len(layers)} layers, {nbytes / 1e6:.0f} MB, isa {kernels.isa_name()}, "
          f"threads {torch.get_num_threads()}, bytes by type {dict(by_type)}")
    if args.prefill:
        return prefill([m for m in layers if m.op != "lm-head"])
    if args.packed_ab:
        return packed_ab(layers)

    print(f"plain read of 1 GiB: {read_bandwidth():.1f} GB/s; default direct rows: {kernels.direct_rows()}")
    for m_rows in (1, 2, 3, 4, 5, 6, 7, 8, 12, 16):
        row = [f"M={m_rows}"]
        for label, sm, bm in (("direct", 16, 0), ("tiles", 0, 0), ("panels", -1, 1)):
            ms = time_set(layers, m_rows, sm, big_m=bm)
            row.append(f"{label} {ms:7.2f} ms {nbytes / ms / 1e6:5.1f} GB/s")
        print("  ".join(row))
    # per type at M = 1: the layers holding only that type
    for t in sorted(by_type):
        sub = [m for m in layers if set(m.gguf.types) == {t}]
        if not sub:
            continue
        b = sum(m.gguf.nbytes for m in sub)
        res = [time_set(sub, 1, sm) for sm in (16, 0)]
        print(f"type {t}: {len(sub)} layers {b / 1e6:.0f} MB  direct {res[0]:.2f} ms "
              f"{b / res[0] / 1e6:.1f} GB/s  tiles {res[1]:.2f} ms {b / res[1] / 1e6:.1f} GB/s")


if __name__ == "__main__":
    main()
