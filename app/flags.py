"""The engine flags every command shares, as the WorkerConfig each --device starts from."""
from __future__ import annotations

from engine.config import WorkerConfig, parse_size
from engine.errors import ConfigError


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
