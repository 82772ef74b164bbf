"""What CPU this is: its model name and the instruction sets every speed figure depends on.

Kernels, packing layouts and speeds differ between an AVX2-only EPYC, an AVX-512 EPYC and a
Sapphire Rapids with AMX, so benchmark reports and load errors name the CPU they ran on.
"""
from __future__ import annotations

import functools
import platform

# The flags that change which kernel runs (as /proc/cpuinfo spells them).
ISA_FLAGS = ("avx2", "fma", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


@functools.cache
def cpu_info() -> dict:
    """{'model': ..., 'family': 'F/M', 'isa': [...], 'torch_capability': ...} for this machine."""
    try:
        with open("/proc/cpuinfo") as f:
            info = parse_cpuinfo(f)
    except OSError:
        info = parse_cpuinfo([])
    try:
        import torch
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - informational only
        capability = "unknown"
    return {**info, "torch_capability": capability}


def parse_cpuinfo(lines) -> dict:
    """The first processor's model name, family/model and ISA flags from /proc/cpuinfo's lines.
    `family` is cpuid's family/model: a VM often names every EPYC just "AMD EPYC", while Zen 3
    is 25/1 and Zen 5 26/2 (different speeds, different instruction sets)."""
    model, flags, fam = platform.processor() or platform.machine(), set(), {}
    for line in lines:
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and value.strip():
            model = value.strip()
        elif key in ("cpu family", "model"):
            fam.setdefault(key, value.strip())
        elif key == "flags":
            flags = set(value.split())
            break
    family = f"{fam['cpu family']}/{fam['model']}" if len(fam) == 2 else "unknown"
    return {"model": model, "family": family, "isa": [f for f in ISA_FLAGS if f in flags]}


def cpu_summary() -> str:
    """One line for messages, e.g. 'AMD EPYC (avx2, avx512f, avx512_bf16; torch AVX512)'."""
    info = cpu_info()
    return f"{info['model']} ({', '.join(info['isa']) or 'no AVX2'}; torch {info['torch_capability']})"


def has_flag(flag: str) -> bool:
    return flag in cpu_info()["isa"]


def last_level_cache_bytes(sysfs: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """Bytes of the largest cache CPU 0 reports (sysfs `index*/size`, e.g. '307200K'); 0 where
    sysfs does not say. A VM may report a large host's cache: an Emerald Rapids guest reads
    300 MiB here."""
    import glob
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    largest = 0
    for path in glob.glob(f"{sysfs}/index*/size"):
        try:
            with open(path) as f:
                text = f.read(32).strip()
            largest = max(largest, int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
        except (OSError, ValueError):
            continue
    return largest
