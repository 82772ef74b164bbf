"""Where the packed kernels prefetch the next panel's weights: into L1, or into L2 only.

Which is faster depends on the machine's memory system, not on its ISA. On a Zen 4 (2 threads)
the prefetches into L1 held the core's L1 miss buffers, the current panel's loads waited behind
them, and the 0.5B's linear layers ran 1.19x slower at one row, 1.34x at two; on Zen 5 the
built panels' prefetch into L2 measured 1.06-1.15x slower than into L1. So neither is assumed:
the first load of a model on a machine times the model's own linear layers at 1 and 2 rows
both ways, alternated, and takes L2 only where it is clearly faster. One row counts because it
is decode's common case and reads the packed copies of every type (timed at 2 rows alone, an
Emerald Rapids chose L1 where L2 made the 0.5B's one-row layers 1.10x faster). The choice is
cached (profiles.json, beside the speed profiles) per CPU, kernel build and model file;
TOKENTOP_PACKED_PREFETCH=l1|l2 set by hand wins, and --recalibrate measures again. It applies
to calls of up to 8 rows (the kernels' PREFETCH_L2_MAX_ROWS); larger ones keep L1. Both ways
compute the same bits.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from engine import kernels
from engine.stats import median
from engine.worker.profile import load_profiles, profile_path, save_profile

log = logging.getLogger(__name__)

ENV = "TOKENTOP_PACKED_PREFETCH"
CHOICES = ("l1", "l2")
ROUNDS = 8            # alternated rounds per way (ABBA)
TIMED_ROWS = (1, 2)   # one stream's decode, and the smallest batch
CLEAR_WIN = 0.99      # L2 is taken only when the rounds' median L2 / L1 is below this
_set_here: str | None = None    # what this module put in ENV (a value the user set wins)


def cache_path() -> Path:
    return profile_path()


def _user_choice() -> str | None:
    value = os.environ.get(ENV)
    return value if value is not None and value != _set_here else None


def _key(model_path: str) -> str:
    from engine.cpuinfo import cpu_info
    info = cpu_info()
    st = os.stat(model_path)
    return (f"packed-prefetch|{info['model']}|{info['family']}|{kernels.build_key()}|"
            f"{Path(model_path).name}:{st.st_size}")


def _packed_layers(model) -> list:
    from engine.models.quant import QuantLinear
    return [m for m in model.modules()
            if isinstance(m, QuantLinear) and m.kernel_forms().get("gguf-tiles")]


def _time_once(calls) -> float:
    t0 = time.perf_counter()
    for op, x in calls:
        op(x)
    return time.perf_counter() - t0


def measure(model, rounds: int = ROUNDS) -> dict:
    """Seconds to run every packed linear layer once at 1 row and once at 2 rows, per way
    (medians of alternated rounds, ABBA), the median of the rounds' L2 / L1, and the way that
    won."""
    calls = []
    for rows in TIMED_ROWS:
        for m in _packed_layers(model):
            g = m.gguf
            x = torch.zeros(rows, m.in_features)
            calls.append((lambda x, g=g, m=m: torch.ops.tokentop.qmatmul(x, g.tensors, g.types, g.rows, None, -1,
                                                                          m.small_m), x))
    times = {c: [] for c in CHOICES}
    before = os.environ.get(ENV)
    try:
        for r in range(rounds):
            for way in (CHOICES if r % 2 == 0 else CHOICES[::-1]):
                os.environ[ENV] = way
                _time_once(calls)                 # the first pass after a switch warms the caches
                times[way].append(_time_once(calls))
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before
    l1, l2 = median(times["l1"]), median(times["l2"])
    # the median of the rounds' ratios: a drift of the machine's bandwidth over the rounds
    # moves both ways of a round alike
    ratio = median([b / a for a, b in zip(times["l1"], times["l2"])])
    return {"l1_s": round(l1, 6), "l2_s": round(l2, 6), "l2_over_l1": round(ratio, 3),
            "choice": "l2" if ratio < CLEAR_WIN else "l1"}


def choose(model, model_path: str, recalibrate: bool = False) -> str:
    """Set ENV for this process from the cache or a measurement on `model`; returns the way
    in force. Nothing is measured where no layer reads a packed copy, or where the weights fit
    in the last-level cache (then they are not streamed from memory)."""
    user = _user_choice()
    if user is not None:
        return user
    layers = _packed_layers(model)
    if not layers or kernels.isa_name() != "avx512":
        return _apply("l1")
    from engine.cpuinfo import last_level_cache_bytes
    if sum(m.gguf.nbytes for m in layers) <= last_level_cache_bytes():
        return _apply("l1")
    key = _key(model_path)
    cached = load_profiles()
    entry = cached.get(key) if isinstance(cached, dict) else None
    if recalibrate or not isinstance(entry, dict) or entry.get("choice") not in CHOICES:
        entry = measure(model)
        log.info("packed kernels prefetch into %s (1- and 2-row linear layers: L1 %.1f ms, L2 %.1f ms)",
                 entry["choice"].upper(), entry["l1_s"] * 1000, entry["l2_s"] * 1000)
        try:
            save_profile(key, entry)
        except (OSError, TypeError) as exc:   # unwritable, or not a dict: measured again next start
            log.warning("could not cache the prefetch choice in %s: %s", profile_path(), exc)
    return _apply(entry["choice"])


def _apply(way: str) -> str:
    global _set_here
    os.environ[ENV] = way
    _set_here = way
    return way
