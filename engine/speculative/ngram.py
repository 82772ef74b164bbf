"""Prompt-lookup proposals (vLLM's ngram proposer): continue the latest earlier occurrence
of the sequence's last n tokens, longest n first. No model: code edits, which repeat their
input, are the case it is made for."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed an earlier match of the last n tokens (the latest one
    with k tokens after it, if any), for the largest n in [min_n, max_n] that matches;
    [] when nothing matches."""
    if k <= 0 or len(tokens) <= min_n:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    total = len(arr)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        pattern = arr[total - n:]
        # windows starting at 0 .. total - n - 1: every occurrence but the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(arr[:total - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            # the latest match with the most continuation (up to k): a run like "a a a a"
            # matches right before its end too, where only one token follows
            room = np.minimum(k, total - hits - n)
            start = int(hits[room == room.max()][-1]) + n
            return arr[start:start + k].tolist()
    return []
