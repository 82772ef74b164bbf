"""Flags and the engine's fields, both ways: the engine flags every command shares as the
WorkerConfig each --device starts from, and the engine's messages, which name settings by
field (`max_context`, `kv_cache_memory=256MiB`: engine/errors.py), with those fields as flags."""
from __future__ import annotations

import re

from engine import errors
from engine.config import SETTING_NAMES, WorkerConfig, parse_size
from engine.errors import ConfigError
from engine.outside import visible

# Every setting field the command line sets, with the flag that sets it (engine/config.py's names).
FIELD_FLAGS = {name: f"--{flag}" for name, flag in SETTING_NAMES.items()}
FIELD_IN_MESSAGE = re.compile(r"`([a-z][a-z0-9_]*)(?:=([^`]*))?`")


def as_flags(text: str) -> str:
    """An engine message as the command line says it: `max_context` -> --max-context,
    `kv_cache_memory=256MiB` -> --kv-cache-memory 256MiB. Backticked text that is no field
    (a command, a file name) stays as it is."""
    def flag(m: re.Match) -> str:
        name, value = m.groups()
        if name not in FIELD_FLAGS:
            return m.group()
        return FIELD_FLAGS[name] if value is None else f"{FIELD_FLAGS[name]} {value}"
    return FIELD_IN_MESSAGE.sub(flag, text)


def describe_error(exc: BaseException) -> str:
    """engine.errors.describe_error, with the settings it names as flags, ready to print or
    draw: an error quotes what it refused (a value, a file name, a server's answer), which
    may hold control characters."""
    return visible(as_flags(errors.describe_error(exc)))


def worker_from_flags(flags) -> WorkerConfig:
    """The engine flags of any command (argparse names: `--kv-cache` is flags.kv_cache) as the
    WorkerConfig every --device starts from. One place, so no command drops a flag."""
    if flags.max_context is not None and flags.max_context < 2:   # 0 means "the model's" only inside
        raise ConfigError(f"--max-context must be at least 2 tokens (a prompt token and an output "
                          f"token), got {flags.max_context}; e.g. --max-context 4096")
    return WorkerConfig(
        model=flags.model, threads=flags.threads, max_active=flags.max_active,
        max_batched_tokens=flags.max_batched_tokens, max_context=flags.max_context or 0,
        page_size=flags.page_size, kv_cache_memory=parse_size(flags.kv_cache_memory),
        kv_cache=flags.kv_cache, kv_dtype=flags.kv_dtype, policy=flags.policy, deterministic=flags.deterministic,
        activation_dtype=flags.activation_dtype, recalibrate=flags.recalibrate,
        speculate=flags.speculate or ("draft" if flags.draft_model else "off"), draft_model=flags.draft_model,
        spec_k=flags.spec_k, spec_tv_budget=flags.spec_tv_budget, spec_bonus=not flags.no_spec_bonus,
        ngram_min=flags.ngram_min, ngram_max=flags.ngram_max,
        prefix_cache=flags.prefix_cache, single_flight=flags.single_flight,
        cuda_graphs=flags.cuda_graphs or "on", cuda_graphs_asked=flags.cuda_graphs is not None,
        # a speed profile only matters when a router has a choice to make
        calibrate=len(flags.device or ["cpu"]) > 1 or flags.recalibrate)
