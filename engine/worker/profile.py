"""Measured speed of one worker: prefill and decode tok/s per (model, device, dtype, threads).

The cost router needs each worker's rates. A real worker measures them with a short
calibration on first use (best of 3 tries of a 256-token prefill and 8 decode steps, through the real runner
and KV cache) and caches them in the platformdirs cache dir; `--recalibrate` measures
again. Simulated workers report their declared rates.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import platformdirs

from engine.config import SamplingParams
from engine.worker.scheduler import ScheduledSeq, StepPlan
from engine.worker.sequence import Sequence, SeqState

PREFILL_TOKENS = 256
DECODE_STEPS = 8
TRIES = 3


def profile_path() -> Path:
    root = os.environ.get("TOKENTOP_CACHE_DIR") or platformdirs.user_cache_dir("tokentop")
    return Path(root) / "profiles.json"


def profile_key(model_path: str, device: str, dtype: str, threads: int) -> str:
    st = os.stat(model_path)
    return f"{Path(model_path).name}:{st.st_size}|{device}|{dtype}|threads={threads}"


def load_profiles() -> dict:
    try:
        return json.loads(profile_path().read_text())
    except (OSError, ValueError):
        return {}   # missing or corrupt: calibrate again


def save_profile(key: str, profile: dict) -> None:
    path = profile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    profiles = load_profiles()
    profiles[key] = profile
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(profiles, indent=1))
    os.replace(tmp, path)   # atomic: two workers calibrating at once can't corrupt the file


def calibrate(runner, blocks) -> dict:
    """Time one prefill and a few decode steps of a scratch sequence on this worker."""
    vocab = runner.tokenizer.vocab_size
    ids = [(i * 7919) % vocab for i in range(PREFILL_TOKENS)]
    seq = Sequence("calibration", ids, SamplingParams(max_tokens=DECODE_STEPS + 1, ignore_eos=True))
    runner.start_sequence(seq)
    try:
        blocks.grow(seq, PREFILL_TOKENS + DECODE_STEPS + 1)
        seq.state = SeqState.PREFILL
        _run(runner, blocks, seq, 8)            # warm-up: first calls allocate and pick kernels
        # Best of a few tries: other processes starting at the same moment (sibling workers
        # importing torch) can only make a try slower, never faster.
        prefill_s = decode_s = float("inf")
        for _ in range(TRIES):
            seq.num_computed, seq.output_ids = 0, []
            seq.state = SeqState.PREFILL
            t0 = time.perf_counter()
            token = _run(runner, blocks, seq, PREFILL_TOKENS)
            prefill_s = min(prefill_s, time.perf_counter() - t0)
            seq.state = SeqState.DECODE
            t0 = time.perf_counter()
            for _ in range(DECODE_STEPS):
                seq.output_ids.append(token)
                token = _run(runner, blocks, seq, 1)
            decode_s = min(decode_s, time.perf_counter() - t0)
    finally:
        blocks.free(seq)
        runner.end_sequence(seq)
    return {"prefill_tps": PREFILL_TOKENS / prefill_s, "decode_tps": DECODE_STEPS / decode_s,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _run(runner, blocks, seq: Sequence, n: int) -> int:
    plan = StepPlan([ScheduledSeq(seq, n, True)], [])
    sampled, errors = runner.execute(plan, blocks)
    if errors:
        raise RuntimeError(f"calibration step failed: {errors[seq.id]}")
    seq.num_computed += n
    return sampled[seq.id][0]


def worker_profile(runner, blocks, cfg, model_path: str) -> dict:
    """Cached profile for this worker, or a fresh calibration (and cache it)."""
    if cfg.kind.declared_rates:
        return {"prefill_tps": cfg.sim_prefill_tps, "decode_tps": cfg.sim_decode_tps, "source": "declared"}
    import torch
    # the kernel forms key it too: rates measured on the torch fallback (while the kernels
    # build on first use) are not the kernels' rates
    forms = runner.info.get("dtype", "?") + "/" + runner.info.get("kernels", "")
    if getattr(runner, "graphs", None) is not None:   # replayed decode steps: other rates
        forms += "/cuda-graphs"
    key = profile_key(model_path, cfg.device, forms, cfg.threads or torch.get_num_threads())
    if not cfg.recalibrate:
        cached = load_profiles().get(key)
        if cached:
            return {**cached, "source": "cached"}
    profile = calibrate(runner, blocks)
    save_profile(key, profile)
    return {**profile, "source": "measured"}
