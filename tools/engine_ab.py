"""A/B of the whole engine between two checkouts: bench batching's burst at N = 1 and N = 8 (ABBA)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

USAGE = """\
bench batching's burst: N requests of 128 tokens at once, in process, paged K/V. Each round runs
both checkouts in fresh processes (PYTHONPATH = that checkout, so its kernels are built and
used), alternating the order round by round (ABBA), so a slow spell of a shared machine hits
both sides; prints each round, the medians and the median of the rounds' ratios.
  git worktree add /tmp/base HEAD~1 && python tools/engine_ab.py /tmp/base,$PWD 8
"""

# The child runs in either checkout, so it takes the names of both layouts: a checkout from
# before the engine's split has no with_worker and calls its burst helper _burst.
CHILD = r'''
import json
import app.cli as cli
try:
    from engine.bench import common as sc
except ImportError:     # a checkout before engine/bench/common.py
    from engine.bench import scenarios as sc
args = cli.build_parser().parse_args(["bench", "batching", "--threads", "2"])
args = cli.with_worker(args) if hasattr(cli, "with_worker") else args
burst = getattr(sc, "timed_burst", None) or getattr(sc, "_burst")
engine = sc.start_engine([sc.base_worker(args, max_active=8, kv_cache="paged")])
burst(engine, 2, 8, True, "warm")
burst(engine, 1, 8, True, "warm")
out = {n: n * 128 / burst(engine, n, 128, True, f"r{n}") for n in (1, 8)}
sc.stop_engine(engine)
print(json.dumps(out))
'''


def run_side(path: str) -> dict:
    env = dict(os.environ, PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=path, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"{path}: the burst failed:\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, epilog=USAGE,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trees", help="the two checkouts, comma-separated: /path/a,/path/b")
    ap.add_argument("rounds", nargs="?", type=int, default=6, help="rounds (default 6)")
    args = ap.parse_args()
    if args.trees.count(",") != 1:
        ap.error("give exactly two checkouts: /path/a,/path/b")
    a, b = args.trees.split(",")
    rounds = args.rounds
    res: dict[str, list[dict]] = {a: [], b: []}
    for r in range(rounds):
        for side in ((a, b) if r % 2 == 0 else (b, a)):
            res[side].append(run_side(side))
            print(r, side, {n: round(v, 2) for n, v in res[side][-1].items()}, flush=True)
    for n in ("1", "8"):
        ratios = [x[n] / y[n] for x, y in zip(res[b], res[a])]
        print(f"N={n}: {a} {statistics.median(x[n] for x in res[a]):.2f}, {b} "
              f"{statistics.median(x[n] for x in res[b]):.2f} tok/s; {b} / {a} rounds "
              f"{[round(x, 3) for x in ratios]}, median {statistics.median(ratios):.3f}")
    for side in (a, b):
        per_round = [x["8"] / x["1"] for x in res[side]]
        print(f"{side}: N8/N1 rounds {[round(x, 3) for x in per_round]}, median {statistics.median(per_round):.3f}")


if __name__ == "__main__":
    main()
