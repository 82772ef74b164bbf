"""Parse repeatable --device specs into WorkerConfigs, refusing bad ones with a fix.

  cpu                         a CPU worker
  cuda | cuda:N               a GPU worker; each bare `cuda` claims the next free index
  sim:NAME[:prefill=R,decode=R[,jitter=J]]
                              a simulated worker (no model run; labelled simulated).
                              NAME starting with gpu/cpu uses the seeds' measured M2 rates
                              when no rates are given (gpu: 2551/293 tok/s, cpu: 73/45).
"""
from __future__ import annotations

from dataclasses import replace

from engine.config import WorkerConfig
from engine.errors import ConfigError

# Isolated backend profiles from the seeds (Qwen2.5 0.5B, Apple M2): prefill, decode tok/s
SIM_PRESETS = {"gpu": (2551.0, 293.0), "cpu": (73.0, 45.0)}


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
        else:
            raise ConfigError(f"unknown device {spec!r}; use cpu, cuda, cuda:N or "
                              "sim:NAME[:prefill=R,decode=R] (e.g. --device sim:gpu0)")
    names = [w.name for w in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"two workers share a name in {names}; give simulated workers distinct names")
    return tuple(w.validate() for w in out)


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
    except ValueError:
        raise ConfigError(f"cannot read size {text!r}; write e.g. 256MiB or 2GiB") from None


# Resident memory of a CPU worker per byte of GGUF file, measured with `tokentop bench single`
# with the GGUF-native kernels (the mapped file is the weight): 0.5B 491 MB file, 1114 MB
# peak RSS (2.3x); 1.5B 1117 MB file, 1761 MB (1.6x). The rest is torch, KV cache, activations.
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
               for w in workers if w.device == "cpu")
    if need > available:
        n = sum(w.device == "cpu" for w in workers)
        raise ConfigError(f"{n} CPU worker(s) need about {need / 2**30:.1f} GiB (model copies + KV cache) "
                          f"but only {available / 2**30:.1f} GiB is available; use fewer --device cpu "
                          "workers or a smaller --kv-cache-memory")
