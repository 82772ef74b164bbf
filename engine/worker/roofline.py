"""The roofline, live: how close a worker's decode steps run to what this machine can read.

A decode step reads every weight once (whatever its row count) and each sequence's K/V; one
row's step is bound by that read. At start-up a CPU worker measures the machine's read
bandwidth (a float32 sum of a buffer larger than the caches) and a float32 matmul peak, a few
hundred ms, cached per CPU model and thread count beside the speed profiles (`--recalibrate`
measures them again: a busy machine at the first start caches low ceilings). Its decode steps
then report the bytes they read per second of stepping as GB/s, as a share of that bandwidth,
and their multiply-adds as a share of the matmul peak (what bounds a many-row step). The matmul
peak is torch's float32 one: the quantized kernels' integer dots can exceed it, so a share over
100% is possible there and means the arithmetic is not what bounds the step.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager

from engine.cpuinfo import cpu_info, last_level_cache_bytes
from engine.worker.profile import load_profiles, save_profile

READ_MIN_BYTES = 1 << 28   # the read test's buffer: at least this, and twice the last-level cache
READ_MAX_BYTES = 1 << 31
READ_REPS = 10         # the fastest of ten: other tenants only ever slow a read down
MATMUL_N = 1024
MATMUL_REPS = 3
WINDOW_S = 5.0           # the live figures cover the decode steps of the last 5 s


def ceilings_key(threads: int) -> str:
    info = cpu_info()
    return f"roofline|{info['model']}|{info['family']}|threads={threads}"


def read_test_bytes(llc_bytes: int | None = None) -> int:
    """The read test's buffer: twice the last-level cache, so that a pass reads memory and not
    the cache (a 256 MiB buffer fits a 300 MiB L3), between 256 MiB and 2 GiB."""
    llc = last_level_cache_bytes() if llc_bytes is None else llc_bytes
    return min(READ_MAX_BYTES, max(READ_MIN_BYTES, 2 * llc))


@contextmanager
def on_threads(threads: int | None):
    """torch's intra-op threads set to `threads` (None or 0: left as they are) for the block,
    then put back."""
    import torch
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure_read_gbs(nbytes: int | None = None, reps: int = READ_REPS) -> float:
    """GB/s of the fastest of `reps` float32 sums of an nbytes buffer (default
    read_test_bytes()), on torch's threads."""
    import torch
    nbytes = nbytes or read_test_bytes()
    buf = torch.ones(nbytes // 4)
    buf.sum()   # the first pass faults the pages in
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def measure_matmul_gflops(n: int = MATMUL_N, reps: int = MATMUL_REPS) -> float:
    """GFLOP/s of the fastest of `reps` n×n float32 matmuls, on torch's threads."""
    import torch
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def in_passing_thread(fn):
    """fn() on a thread of its own that ends with it. torch's parallel ops give the thread that
    runs them an OpenMP team of its own; one left on a thread that does not decode (`bench
    rows` measured its ceilings on its main thread, then ran a thread-mode worker) made every
    step of that worker 1.5x slower. A team ends with its thread."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            out["error"] = exc

    t = threading.Thread(target=run, name="tokentop-ceilings")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def machine_ceilings(threads: int, remeasure: bool = False, measure: bool = True) -> dict:
    """{"read_gbs", "matmul_gflops", "source"} on `threads` threads, cached for this CPU and
    thread count; {} when not cached and measure is False."""
    import torch
    threads = threads if threads > 0 else torch.get_num_threads()
    key = ceilings_key(threads)
    cached = None if remeasure else load_profiles().get(key)
    if cached and cached.get("read_gbs") and cached.get("matmul_gflops"):
        return {**cached, "source": "cached"}
    if not measure:
        return {}

    def measure_both() -> dict:
        with on_threads(threads):
            return {"read_gbs": round(measure_read_gbs(), 2), "matmul_gflops": round(measure_matmul_gflops(), 1),
                    "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}

    found = in_passing_thread(measure_both)
    try:
        save_profile(key, found)
    except OSError:
        pass   # an unwritable cache only costs the next start a measurement
    return {**found, "source": "measured"}


def weight_traffic(gguf) -> tuple[int, int]:
    """(bytes, multiply-adds per row) of the weights one decode step reads, from the GGUF
    tensors: every matrix, and the token embedding only where it doubles as the output layer
    (else a step gathers one of its rows)."""
    tied = not gguf.has("output.weight")
    nbytes = macs = 0
    for name, t in gguf.tensors.items():
        if name == "token_embd.weight" and not tied:
            continue
        nbytes += t.nbytes
        if len(t.shape) == 2:
            macs += t.shape[0] * t.shape[1]
    return nbytes, macs


def worker_traffic(runner, cfg, threads: int, measure: bool = True) -> DecodeTraffic | None:
    """A real CPU worker's live roofline (None elsewhere); `--recalibrate` measures again."""
    if cfg.simulated or getattr(runner, "device", None) is None or runner.device.type != "cpu":
        return None
    ceilings = machine_ceilings(threads, remeasure=cfg.recalibrate, measure=measure)
    return DecodeTraffic(runner.weight_bytes, runner.weight_macs, runner.kv_bytes_per_token, ceilings)


class DecodeTraffic:
    """The bytes and multiply-adds of a worker's recent decode steps against its ceilings."""

    def __init__(self, weight_bytes: int, weight_macs: int, kv_bytes_per_token: int, ceilings: dict):
        self.weight_bytes, self.weight_macs = weight_bytes, weight_macs
        self.kv_bytes_per_token = kv_bytes_per_token
        self.ceilings = ceilings
        self._steps: deque[tuple[float, float, int, int]] = deque()   # (at, seconds, bytes, rows)

    def step_bytes(self, context_tokens: int) -> int:
        """Bytes one decode step reads: the weights once, and the K/V of every context token."""
        return self.weight_bytes + self.kv_bytes_per_token * context_tokens

    def add(self, now: float, seconds: float, rows: int, context_tokens: int) -> None:
        self._steps.append((now, seconds, self.step_bytes(context_tokens), rows))
        while self._steps and now - self._steps[0][0] > WINDOW_S:
            self._steps.popleft()

    def as_dict(self, now: float) -> dict | None:
        """read_gbs, read_share, bandwidth_gbs, rows, compute_share, peak_gflops; None when
        no decode step ran in the window."""
        steps = [s for s in self._steps if now - s[0] <= WINDOW_S]
        seconds = sum(s[1] for s in steps)
        if not steps or seconds <= 0:
            return None
        read = sum(s[2] for s in steps) / seconds / 1e9
        gflops = 2 * self.weight_macs * sum(s[3] for s in steps) / seconds / 1e9
        bandwidth, peak = self.ceilings.get("read_gbs"), self.ceilings.get("matmul_gflops")
        return {"read_gbs": round(read, 2), "bandwidth_gbs": bandwidth,
                "read_share": round(read / bandwidth, 3) if bandwidth else None,
                "rows": round(sum(s[3] for s in steps) / len(steps), 2),
                "gflops": round(gflops, 1), "peak_gflops": peak,
                "compute_share": round(gflops / peak, 3) if peak else None}
