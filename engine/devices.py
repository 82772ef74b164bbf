"""Parse repeatable --device specs into WorkerConfigs, refusing bad ones with a fix.

  cpu                         a CPU worker
  cuda | cuda:N               a GPU worker; each bare `cuda` claims the next free index
  sim:NAME[:prefill=R,decode=R[,jitter=J]]
                              a simulated worker (no model run; labelled simulated).
                              NAME starting with gpu/cpu uses mini-vllm-rs's published
                              Apple M2 rates when no rates are given (gpu: 2551/293 tok/s,
                              cpu: 73/45).
"""
from __future__ import annotations

import os
from dataclasses import replace

from engine.config import KV_DTYPES, WorkerConfig
from engine.errors import ConfigError

# Activation dtypes found unfaithful on a device type: greedy ids left the fp32 reference at a
# step that is not a near-tie (tools/gpu_check.py, fidelity section). A worker asking for one
# is refused at start-up with the reason; 'auto' never picks one. Filled from measured runs only.
UNFAITHFUL_ACTIVATION_DTYPES: dict[str, dict[str, str]] = {}

# Isolated backend profiles published by mini-vllm-rs ("From a Rust Inference Engine to
# Heterogeneous Serving": Qwen2.5 0.5B on an Apple M2, Metal GPU and CPU): prefill, decode tok/s
SIM_PRESETS = {"gpu": (2551.0, 293.0), "cpu": (73.0, 45.0)}


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
        activation_dtype=flags.activation_dtype, weights=flags.weights, recalibrate=flags.recalibrate,
        speculate=flags.speculate or ("draft" if flags.draft_model else "off"), draft_model=flags.draft_model,
        spec_k=flags.spec_k, spec_tv_budget=flags.spec_tv_budget, spec_bonus=not flags.no_spec_bonus,
        ngram_min=flags.ngram_min, ngram_max=flags.ngram_max,
        prefix_cache=flags.prefix_cache, single_flight=flags.single_flight,
        # a speed profile only matters when a router has a choice to make
        calibrate=len(flags.device or ["cpu"]) > 1 or flags.recalibrate)


def parse_devices(specs: list[str], base: WorkerConfig) -> tuple[WorkerConfig, ...]:
    specs = specs or ["cpu"]
    out: list[WorkerConfig] = []
    claimed: set[int] = set()
    for spec in specs:
        spec = spec.strip()
        if spec == "cpu":
            out.append(replace(base, device="cpu", name=f"cpu{sum(w.device == 'cpu' for w in out) or ''}"))
        elif spec == "cuda" or spec.startswith("cuda:"):
            index = _claim_cuda(spec, claimed)
            out.append(replace(base, device=f"cuda:{index}", name=f"cuda:{index}"))
        elif spec.startswith("sim:"):
            out.append(_parse_sim(spec, base))
        elif spec.startswith("remote:"):
            from engine.remote import parse_remote
            out.append(parse_remote(spec, base, sum(w.remote for w in out)))
        else:
            raise ConfigError(f"unknown device {spec!r}; use cpu, cuda, cuda:N or "
                              "sim:NAME[:prefill=R,decode=R] (e.g. --device sim:gpu0) or remote:URL[,name=NAME]")
    for w in out:
        if not w.simulated and not w.remote:   # a remote's dtype is its own business
            check_activation_dtype(w.device, w.activation_dtype)
    names = [w.name for w in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"two workers share a name in {names}; give simulated workers distinct names")
    # --threads 0 (all cores) on several CPU workers: they share the cores instead of each taking
    # all of them (two OpenMP teams on the same cores wait for each other: decode slows many times)
    n_cpu = sum(w.device == "cpu" for w in out)
    if n_cpu > 1:
        share = max(1, usable_cores() // n_cpu)
        out = [replace(w, threads=share) if w.device == "cpu" and w.threads == 0 else w for w in out]
    return tuple(w.validate() for w in out)


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def too_many_threads(index: int, workers: list) -> str:
    """More threads on CPU workers than the cores this process may use: their OpenMP threads wait
    for each other, and decode slows many times over (docs/benchmarks.md). Said once, at the
    first CPU worker; `workers` are the engine's WorkerConfigs."""
    cores = usable_cores()
    cpu = [i for i, w in enumerate(workers) if w.device == "cpu"]
    total = sum(workers[i].threads or cores for i in cpu)
    if not cpu or index != cpu[0] or total <= cores:
        return ""
    if len(cpu) == 1:
        return (f"--threads {total} is more than the {cores} cores this process may use; threads that wait "
                f"for each other slow CPU decode many times over: use --threads {cores} or 0 (all)")
    return (f"{len(cpu)} CPU workers run {total} threads in all on the {cores} cores this process may use; "
            f"threads that wait for each other slow CPU decode many times over: give them --threads "
            f"{max(1, cores // len(cpu))}")


def check_activation_dtype(device: str, requested: str) -> str:
    """The activation dtype a worker on `device` uses ('bf16', 'fp16' or 'fp32'), refusing one
    measured unfaithful there. 'auto' is bf16, or fp32 where bf16 itself was refused."""
    kind = device.split(":", 1)[0]
    refused = UNFAITHFUL_ACTIVATION_DTYPES.get(kind, {})
    if requested == "auto":
        return next(d for d in ("bf16", "fp32") if d not in refused or d == "fp32")
    if requested not in ("bf16", "fp16", "fp32"):
        raise ConfigError(f"--activation-dtype must be auto, bf16, fp16 or fp32, got {requested!r}")
    if requested in refused:
        ok = [d for d in ("bf16", "fp32") if d not in refused]
        raise ConfigError(f"--activation-dtype {requested} is refused on {kind}: {refused[requested]}; "
                          f"use --activation-dtype {ok[0]} (or auto)")
    return requested


# The K/V store dtype that --kv-dtype auto picks per device type (measured: docs/benchmarks.md,
# "KV dtype"). Not listed: fp32.
DEFAULT_KV_DTYPE: dict[str, str] = {}


def resolve_kv_dtype(device: str, requested: str) -> str:
    """'fp32', 'bf16' or 'fp16': what a worker on `device` stores K and V in."""
    if requested not in KV_DTYPES:
        raise ConfigError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {requested!r}")
    if requested != "auto":
        return requested
    return DEFAULT_KV_DTYPE.get(device.split(":", 1)[0], "fp32")


def kv_bytes_per_slot(config, device: str, kv_dtype: str) -> int:
    """K and V of one token position, every layer, in the dtype the worker stores them in."""
    from engine.models.batch import KV_TORCH_DTYPES, KVStore
    return KVStore.bytes_per_slot(config.n_layers, config.n_kv_heads, config.head_dim,
                                  KV_TORCH_DTYPES[resolve_kv_dtype(device, kv_dtype)])


def _claim_cuda(spec: str, claimed: set[int]) -> int:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError(f"--device {spec}: no CUDA GPU is visible to this torch build "
                          f"({torch.__version__}); use --device cpu, or --device sim:gpu0 to simulate one")
    if spec == "cuda":
        free = [i for i in range(count) if i not in claimed]
        if not free:
            raise ConfigError(f"--device cuda: all {count} GPU(s) are already claimed by earlier --device flags")
        index = free[0]
    else:
        try:
            index = int(spec.split(":", 1)[1])
        except ValueError:
            raise ConfigError(f"--device {spec}: write cuda:N with N a GPU index, e.g. cuda:0") from None
        if not 0 <= index < count:
            raise ConfigError(f"--device {spec}: only GPUs 0..{count - 1} exist")
        if index in claimed:
            raise ConfigError(f"--device {spec}: GPU {index} is already used by another worker")
    claimed.add(index)
    return index


def _parse_sim(spec: str, base: WorkerConfig) -> WorkerConfig:
    parts = spec.split(":", 2)
    name = parts[1] if len(parts) > 1 else ""
    if not name:
        raise ConfigError("--device sim: needs a name, e.g. sim:gpu0 or sim:fast:prefill=2000,decode=300")
    rates: dict[str, float] = {}
    if len(parts) == 3 and parts[2]:
        for item in parts[2].split(","):
            key, _, value = item.partition("=")
            if key not in ("prefill", "decode", "jitter"):
                raise ConfigError(f"--device {spec}: unknown field {key!r}; use prefill=, decode=, jitter=")
            try:
                rates[key] = float(value)
            except ValueError:
                raise ConfigError(f"--device {spec}: {key} must be a number, got {value!r}") from None
    preset = next((v for k, v in SIM_PRESETS.items() if name.startswith(k)), None)
    if "prefill" not in rates and "decode" not in rates and preset:
        rates["prefill"], rates["decode"] = preset
    missing = [k for k in ("prefill", "decode") if rates.get(k, 0) <= 0]
    if missing:
        raise ConfigError(f"--device {spec}: missing or non-positive {' and '.join(missing)} rate; "
                          f"write e.g. sim:{name}:prefill=2551,decode=293 (tokens/s)")
    jitter = rates.get("jitter", 0.0)
    if not 0 <= jitter < 1:
        raise ConfigError(f"--device {spec}: jitter must be in [0, 1), got {jitter}")
    return replace(base, device=f"sim:{name}", name=f"sim:{name}", sim_prefill_tps=rates["prefill"],
                   sim_decode_tps=rates["decode"], sim_jitter=jitter)


def parse_size(text: str) -> int:
    """'256MiB', '1.5GiB', '512M', '1000000' -> bytes."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    s = text.strip().lower().replace("ib", "").replace("b", "")
    try:
        if s and s[-1] in units:
            return int(float(s[:-1]) * units[s[-1]])
        return int(float(s))
    except (ValueError, OverflowError):
        raise ConfigError(f"cannot read size {text!r}; write e.g. 256MiB or 2GiB") from None


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return ""


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
            raise ConfigError(f"--max-context {w.max_context} is more than {w.model} was trained for "
                              f"({c.context_length} tokens); use --max-context {c.context_length} or less")
        page = kv_bytes_per_slot(c, w.device, w.kv_dtype) * w.page_size
        pages = w.kv_cache_memory // page
        if pages < 1:
            raise ConfigError(f"--kv-cache-memory {format_size(w.kv_cache_memory)} is less than one KV page "
                              f"of {w.model} ({w.page_size} tokens need {format_size(page)}); "
                              "use e.g. --kv-cache-memory 256MiB")
        if pages > MAX_KV_PAGES:
            raise ConfigError(f"--kv-cache-memory {format_size(w.kv_cache_memory)} would be {pages:,} KV pages "
                              f"of {w.model}; a worker manages at most {MAX_KV_PAGES:,} "
                              f"({format_size(MAX_KV_PAGES * page)}); use e.g. --kv-cache-memory 256MiB")


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
    import os

    available = available_memory() if available is None else available
    if available is None:
        return
    need = sum(CPU_BYTES_PER_FILE_BYTE * os.path.getsize(model_paths[w.model]) + w.kv_cache_memory
               + (CPU_BYTES_PER_FILE_BYTE * os.path.getsize(model_paths[w.draft_model])
                  if w.draft_model in model_paths else 0)
               for w in workers if w.device == "cpu")
    if need > available:
        n = sum(w.device == "cpu" for w in workers)
        raise ConfigError(f"{n} CPU worker(s) need about {need / 2**30:.1f} GiB (model copies + KV cache) "
                          f"but only {available / 2**30:.1f} GiB is available; use fewer --device cpu "
                          "workers or a smaller --kv-cache-memory")
