"""Start-up limits checked before any weights load: the model's trained context, KV page
counts, and whether the CPU workers fit in this machine's memory."""
from __future__ import annotations

import os

from engine.config import format_size
from engine.dtypes import kv_bytes_per_slot
from engine.errors import ConfigError


# The page table, refcounts and the dashboard's 5 Hz page-state picture cost per page: past
# 4M pages (64M tokens at 16 per page) no device has the memory and the bookkeeping would swamp it.
MAX_KV_PAGES = 1 << 22


def check_model_limits(workers, model_paths: dict[str, str]) -> None:
    """Flags that depend on the model, checked as soon as its header is read (before any
    weights load): --max-context against its trained context, --kv-cache-memory against the
    size of one KV page (K and V in the dtype each worker stores them in)."""
    from engine.models.gguf import load_gguf

    headers = {}
    for w in workers:
        if w.model not in headers:
            headers[w.model] = load_gguf(model_paths[w.model]).config
        c = headers[w.model]
        if w.max_context > c.context_length:
            raise ConfigError(f"`max_context={w.max_context}` is more than {w.model} was trained for "
                              f"({c.context_length} tokens); use `max_context={c.context_length}` or less")
        page = kv_bytes_per_slot(c, w.device, w.kv_dtype) * w.page_size
        pages = w.kv_cache_memory // page
        if pages < 1:
            raise ConfigError(f"`kv_cache_memory={format_size(w.kv_cache_memory)}` is less than one KV page "
                              f"of {w.model} ({w.page_size} tokens need {format_size(page)}); "
                              "use e.g. `kv_cache_memory=256MiB`")
        if pages > MAX_KV_PAGES:
            raise ConfigError(f"`kv_cache_memory={format_size(w.kv_cache_memory)}` would be {pages:,} KV pages "
                              f"of {w.model}; a worker manages at most {MAX_KV_PAGES:,} "
                              f"({format_size(MAX_KV_PAGES * page)}); use e.g. `kv_cache_memory=256MiB`")


# Resident memory of a CPU worker per byte of GGUF file, measured with `tokentop bench single`
# with the GGUF-native kernels (the mapped file is the weight): 0.5B 491 MB file, 869 MB
# peak RSS (1.8x); 1.5B 1117 MB file, 1554 MB (1.4x). The rest is torch, the tokenizer, the
# K/V written, activations; the KV cap (--kv-cache-memory) is added on top below.
CPU_BYTES_PER_FILE_BYTE = 2.5


def available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(workers, model_paths: dict[str, str], available: int | None = None) -> None:
    """Refuse at start-up a set of CPU workers that cannot fit in this machine's memory."""

    available = available_memory() if available is None else available
    if available is None:
        return
    need = sum(CPU_BYTES_PER_FILE_BYTE * os.path.getsize(model_paths[w.model]) + w.kv_cache_memory
               + (CPU_BYTES_PER_FILE_BYTE * os.path.getsize(model_paths[w.draft_model])
                  if w.draft_model in model_paths else 0)
               for w in workers if w.kind.host_cpu)
    if need > available:
        n = sum(w.kind.host_cpu for w in workers)
        raise ConfigError(f"{n} CPU worker(s) need about {need / 2**30:.1f} GiB (model copies + KV cache) "
                          f"but only {available / 2**30:.1f} GiB is available; use fewer `device=cpu` "
                          "workers or a smaller `kv_cache_memory`")
