"""Simulated workers (`--device sim:NAME`): the real scheduler and KV accounting, no model.

The forward pass is replaced by a timed wait derived from declared rates, and the tokens are
placeholders. Everything a simulated worker produces is labelled "simulated"; it exists so
routing can be studied and tested on machines without the hardware.

Timing model (documented, deliberately simple): the declared rates are the worker's
aggregate throughputs, so a step with P prompt tokens and D decode tokens takes
P / prefill_tps + D / decode_tps seconds, times (1 ± jitter).
"""
from __future__ import annotations

import random
import time


from engine.config import WorkerConfig
from engine.errors import ConfigError
from engine.dtypes import kv_bytes_per_slot
from engine.models.gguf import load_gguf
from engine.models.tokenizer import Tokenizer
from engine.worker.output import SampledToken, StepOutput
from engine.worker.runner_api import Runner
from engine.worker.scheduler import StepPlan

PLACEHOLDER_TEXT = " sim"


class SimRunner(Runner):
    def __init__(self, cfg: WorkerConfig, model_path: str):
        if cfg.sim_prefill_tps <= 0 or cfg.sim_decode_tps <= 0:
            raise ConfigError(f"simulated worker {cfg.device!r} needs both rates, e.g. "
                              "`device=sim:gpu0:prefill=2551,decode=293`")
        self.cfg = cfg
        gf = load_gguf(model_path)          # metadata only (mmap): tokenizer and KV geometry
        self.tokenizer = Tokenizer.from_gguf(model_path, gf.metadata)
        # trusted text without special tokens: parse_special skips building the plain-text copy
        self.placeholder = self.tokenizer.encode(PLACEHOLDER_TEXT, add_special=False, parse_special=True)[0]
        self.model_context = gf.config.context_length
        # page accounting as the real model would need (K and V in --kv-dtype); nothing is allocated
        self.bytes_per_slot = kv_bytes_per_slot(gf.config, cfg.device, cfg.kv_dtype)
        self.rng = random.Random(0)
        self.info = {"model": cfg.model, "arch": "simulated", "dtype": "simulated",
                     "simulated": True,
                     "sim_prefill_tps": cfg.sim_prefill_tps, "sim_decode_tps": cfg.sim_decode_tps}

    def allocate_kv(self, num_slots: int) -> None:
        pass

    def start_sequence(self, seq) -> None:
        seq.detok = _PlaceholderText()

    def end_sequence(self, seq) -> None:
        pass

    def execute(self, plan: StepPlan, blocks) -> StepOutput:
        decode = plan.num_decode
        prefill = plan.num_tokens - decode
        seconds = prefill / self.cfg.sim_prefill_tps + decode / self.cfg.sim_decode_tps
        if self.cfg.sim_jitter:
            seconds *= 1 + self.rng.uniform(-self.cfg.sim_jitter, self.cfg.sim_jitter)
        time.sleep(max(0.0, seconds))
        sampled = {i.seq.id: SampledToken(self.placeholder) for i in plan.items if i.samples}
        return StepOutput(sampled, {})


class _PlaceholderText:
    """Stands in for the detokenizer: every simulated token reads as PLACEHOLDER_TEXT."""

    def push(self, token_id: int) -> str:
        return PLACEHOLDER_TEXT

    def flush(self) -> str:
        return ""
