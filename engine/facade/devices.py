"""Parse repeatable --device specs into WorkerConfigs, refusing bad ones with a fix.

  cpu                         a CPU worker
  cuda | cuda:N               a GPU worker; each bare `cuda` claims the next free index;
                              cuda:N given twice: two workers share GPU N (cuda:N, cuda:N#2)
  sim:NAME[:prefill=R,decode=R[,jitter=J]]
                              a simulated worker (no model run; labelled simulated).
                              NAME starting with gpu/cpu uses mini-vllm-rs's published
                              Apple M2 rates when no rates are given (gpu: 2551/293 tok/s,
                              cpu: 73/45).
"""
from __future__ import annotations

import os
from dataclasses import replace

from engine.config import WorkerConfig
from engine.dtypes import check_activation_dtype
from engine.errors import ConfigError
from engine.worker_kinds import kind_of, load

# Isolated backend profiles published by mini-vllm-rs ("From a Rust Inference Engine to
# Heterogeneous Serving": Qwen2.5 0.5B on an Apple M2, Metal GPU and CPU): prefill, decode tok/s
SIM_PRESETS = {"gpu": (2551.0, 293.0), "cpu": (73.0, 45.0)}


def parse_devices(specs: list[str], base: WorkerConfig) -> tuple[WorkerConfig, ...]:
    """Each spec read by its kind's parser (engine/worker_kinds.py), in order."""
    specs = specs or ["cpu"]
    out: list[WorkerConfig] = []
    for spec in specs:
        spec = spec.strip()
        kind = kind_of(spec)
        if kind is None:
            raise ConfigError(unknown_device(spec))
        out.append(load(kind.parse)(spec, base, out))
    for w in out:
        if w.kind.checks_dtype:   # a remote's dtype is its own business
            check_activation_dtype(w.device, w.activation_dtype)
    names = [w.name for w in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"two workers share a name in {names}; give simulated workers distinct names")
    # --threads 0 (all cores) on several CPU workers: they share the cores instead of each taking
    # all of them (two OpenMP teams on the same cores wait for each other: decode slows many times)
    n_cpu = sum(w.kind.host_cpu for w in out)
    if n_cpu > 1:
        share = max(1, usable_cores() // n_cpu)
        out = [replace(w, threads=share) if w.kind.host_cpu and w.threads == 0 else w for w in out]
    return tuple(w.validate() for w in out)


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def too_many_threads(index: int, workers: list) -> str:
    """More threads on CPU workers than the cores this process may use: their OpenMP threads wait
    for each other, and decode slows many times over (docs/kernels.md, 'One OpenMP team per
    core'). Said once, at the first CPU worker; `workers` are the engine's WorkerConfigs."""
    cores = usable_cores()
    cpu = [i for i, w in enumerate(workers) if kind_of(w.device).host_cpu]
    total = sum(workers[i].threads or cores for i in cpu)
    if not cpu or index != cpu[0] or total <= cores:
        return ""
    if len(cpu) == 1:
        return (f"`threads={total}` is more than the {cores} cores this process may use; threads that wait "
                f"for each other slow CPU decode many times over: use `threads={cores}` or 0 (all)")
    return (f"{len(cpu)} CPU workers run {total} threads in all on the {cores} cores this process may use; "
            f"threads that wait for each other slow CPU decode many times over: give them `threads="
            f"{max(1, cores // len(cpu))}`")


def unknown_device(spec: str) -> str:
    return (f"unknown device {spec!r}; use cpu, cuda, cuda:N or "
            "sim:NAME[:prefill=R,decode=R] (e.g. `device=sim:gpu0`) or remote:URL[,name=NAME][,api_key=ENV_VAR]")


def parse_cpu(spec: str, base: WorkerConfig, earlier: list[WorkerConfig]) -> WorkerConfig:
    if spec != "cpu":
        raise ConfigError(unknown_device(spec))
    return replace(base, device="cpu", name=f"cpu{sum(w.device == 'cpu' for w in earlier) or ''}")


def parse_cuda(spec: str, base: WorkerConfig, earlier: list[WorkerConfig]) -> WorkerConfig:
    if spec != "cuda" and not spec.startswith("cuda:"):
        raise ConfigError(unknown_device(spec))
    claimed = {int(w.device.split(":", 1)[1]) for w in earlier if w.device.startswith("cuda:")}
    device = f"cuda:{_claim_cuda(spec, claimed)}"
    # cuda:N named again: another worker (its own model copy and KV) on the same GPU
    same = sum(w.device == device for w in earlier)
    return replace(base, device=device, name=f"{device}#{same + 1}" if same else device)


def _claim_cuda(spec: str, claimed: set[int]) -> int:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError(f"`device={spec}`: no CUDA GPU is visible to this torch build "
                          f"({torch.__version__}); use `device=cpu`, or `device=sim:gpu0` to simulate one")
    if spec == "cuda":
        free = [i for i in range(count) if i not in claimed]
        if not free:
            raise ConfigError(f"`device=cuda`: all {count} GPU(s) are already claimed by earlier `device` specs")
        index = free[0]
    else:
        try:
            index = int(spec.split(":", 1)[1])
        except ValueError:
            raise ConfigError(f"`device={spec}`: write cuda:N with N a GPU index, e.g. cuda:0") from None
        if not 0 <= index < count:
            raise ConfigError(f"`device={spec}`: only GPUs 0..{count - 1} exist")
    return index


def parse_sim(spec: str, base: WorkerConfig, earlier: list[WorkerConfig]) -> WorkerConfig:
    parts = spec.split(":", 2)
    name = parts[1] if len(parts) > 1 else ""
    if not name:
        raise ConfigError("`device=sim:` needs a name, e.g. sim:gpu0 or sim:fast:prefill=2000,decode=300")
    rates: dict[str, float] = {}
    if len(parts) == 3 and parts[2]:
        for item in parts[2].split(","):
            key, _, value = item.partition("=")
            if key not in ("prefill", "decode", "jitter"):
                raise ConfigError(f"`device={spec}`: unknown field {key!r}; use prefill=, decode=, jitter=")
            try:
                rates[key] = float(value)
            except ValueError:
                raise ConfigError(f"`device={spec}`: {key} must be a number, got {value!r}") from None
    preset = next((v for k, v in SIM_PRESETS.items() if name.startswith(k)), None)
    if "prefill" not in rates and "decode" not in rates and preset:
        rates["prefill"], rates["decode"] = preset
    missing = [k for k in ("prefill", "decode") if rates.get(k, 0) <= 0]
    if missing:
        raise ConfigError(f"`device={spec}`: missing or non-positive {' and '.join(missing)} rate; "
                          f"write e.g. sim:{name}:prefill=2551,decode=293 (tokens/s)")
    jitter = rates.get("jitter", 0.0)
    if not 0 <= jitter < 1:
        raise ConfigError(f"`device={spec}`: jitter must be in [0, 1), got {jitter}")
    return replace(base, device=f"sim:{name}", name=f"sim:{name}", sim_prefill_tps=rates["prefill"],
                   sim_decode_tps=rates["decode"], sim_jitter=jitter)


