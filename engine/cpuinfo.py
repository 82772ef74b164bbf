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
    """{'model': ..., 'isa': [...], 'torch_capability': ...} for this machine."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and value.strip():
                    model = value.strip()
                elif key == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    try:
        import torch
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - informational only
        capability = "unknown"
    return {"model": model, "isa": [f for f in ISA_FLAGS if f in flags],
            "torch_capability": capability}


def cpu_summary() -> str:
    """One line for messages, e.g. 'AMD EPYC (avx2, avx512f, avx512_bf16; torch AVX512)'."""
    info = cpu_info()
    return f"{info['model']} ({', '.join(info['isa']) or 'no AVX2'}; torch {info['torch_capability']})"


def has_flag(flag: str) -> bool:
    return flag in cpu_info()["isa"]
