"""A/B of the linear layers of one decode step between two checkouts of tokentop (ABBA rounds)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

USAGE = """\
Each round runs every checkout in a fresh process (PYTHONPATH = that checkout, so its kernels
are built and used), alternating the order round by round (ABBA), so a slow spell of a shared
machine hits both sides; prints each round, the medians and, for two checkouts, the median of
the rounds' ratios. Times are tools/kernel_bench.py's time_set (every linear layer once, back
to back, the op's default kernel for the row count), in ms; "read" is a plain 2-thread memory
read in GB/s taken right after (compare rounds at the same bandwidth level).
  python tools/kernel_ab.py qwen2.5-coder-1.5b /path/a,/path/b 1,4 6 --op lm-head
TOKENTOP_KERNEL_ISA passes through (e.g. avx2 to time the AVX2 code on an AVX-512 CPU).
"""

CHILD = r'''
import json, sys, torch
sys.path.insert(0, "tools")
from kernel_bench import time_set
from engine.bench.common import read_bandwidth
from engine.models.catalog import resolve_model
from engine.models.decoder import Decoder
from engine.models.gguf import load_gguf
from engine.models.quant import LinearPolicy, QuantLinear
torch.set_num_threads(2)
model = Decoder.from_gguf(load_gguf(str(resolve_model(sys.argv[1]))), LinearPolicy())
layers = [m for m in model.modules() if isinstance(m, QuantLinear) and m.gguf is not None]
if len(sys.argv) > 3:
    layers = [m for m in layers if m.op == sys.argv[3]]
    if not layers:
        sys.exit(f"no linear layer has op {sys.argv[3]!r} (attention-qkv, attention-output, mlp-gate-up, mlp-down, lm-head)")
times = {m: time_set(layers, int(m), -1, reps=11, big_m=-1) for m in sys.argv[2].split(",")}
print(json.dumps({**times, "read": read_bandwidth(1 << 28, 3)}))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, epilog=USAGE,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="catalog name or .gguf path")
    ap.add_argument("trees", help="checkouts to compare, comma-separated: /path/a,/path/b")
    ap.add_argument("rows", nargs="?", default="1", help="row counts, comma-separated (default 1)")
    ap.add_argument("rounds", nargs="?", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--op", default=None, help="only the layers of this QuantLinear.op, e.g. lm-head")
    args = ap.parse_args()
    model, trees, rows, rounds, op = args.model, args.trees.split(","), args.rows, args.rounds, args.op
    results: dict[str, list[dict]] = {t: [] for t in trees}
    for r in range(rounds):
        for tree in trees if r % 2 == 0 else trees[::-1]:   # ABBA: neither side always goes first
            env = dict(os.environ, PYTHONPATH=tree)
            out = subprocess.run([sys.executable, "-c", CHILD, model, rows, *([op] if op else [])], cwd=tree, env=env,
                                 capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{tree}: {out.stderr.strip().splitlines()[-1]}")
            results[tree].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(tree, {m: round(v, 2) for m, v in results[tree][-1].items()}, flush=True)
    for tree, runs in results.items():
        print("median", tree, {m: round(statistics.median(r[m] for r in runs), 2) for m in runs[0]})
    if len(trees) == 2:   # paired: each round ran both back to back
        a, b = results[trees[0]], results[trees[1]]
        print(f"time {trees[0]} / {trees[1]}, median of the rounds' ratios:",
              {m: round(statistics.median(x[m] / y[m] for x, y in zip(a, b)), 3) for m in rows.split(",")})


if __name__ == "__main__":
    main()
