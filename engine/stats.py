"""Summary statistics shared by the benchmarks and the dashboard's burst summaries."""
from __future__ import annotations

import statistics


def median(xs):
    """Median of the values that are not None; None when there are none."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def percentile(values, q: float):
    """Nearest-rank percentile (q in 0..100) of the values that are not None; None when empty."""
    ordered = sorted(v for v in values if v is not None)
    if not ordered:
        return None
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]
