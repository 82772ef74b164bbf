"""Which dtypes a worker computes and stores in, per device type, and what one KV slot costs.

Shared by the facade (start-up checks) and the worker (its runner and KV pool)."""
from __future__ import annotations

from engine.config import KV_DTYPES
from engine.errors import ConfigError

# Activation dtypes found unfaithful on a device type: greedy ids left the fp32 reference at a
# step that is not a near-tie (tools/gpu_check.py, fidelity section). A worker asking for one
# is refused at start-up with the reason; 'auto' never picks one. Filled from measured runs only.
UNFAITHFUL_ACTIVATION_DTYPES: dict[str, dict[str, str]] = {}

def check_activation_dtype(device: str, requested: str) -> str:
    """The activation dtype a worker on `device` uses ('bf16', 'fp16' or 'fp32'), refusing one
    measured unfaithful there. 'auto' is bf16, or fp32 where bf16 itself was refused."""
    kind = device.split(":", 1)[0]
    refused = UNFAITHFUL_ACTIVATION_DTYPES.get(kind, {})
    if requested == "auto":
        return next(d for d in ("bf16", "fp32") if d not in refused or d == "fp32")
    if requested not in ("bf16", "fp16", "fp32"):
        raise ConfigError(f"`activation_dtype` must be auto, bf16, fp16 or fp32, got {requested!r}")
    if requested in refused:
        ok = [d for d in ("bf16", "fp32") if d not in refused]
        raise ConfigError(f"`activation_dtype={requested}` is refused on {kind}: {refused[requested]}; "
                          f"use `activation_dtype={ok[0]}` (or auto)")
    return requested


# The K/V store dtype that --kv-dtype auto picks per device type (measured: docs/kernels.md,
# "KV dtype"). Not listed: fp32.
DEFAULT_KV_DTYPE: dict[str, str] = {}


def resolve_kv_dtype(device: str, requested: str) -> str:
    """'fp32', 'bf16' or 'fp16': what a worker on `device` stores K and V in."""
    if requested not in KV_DTYPES:
        raise ConfigError(f"`kv_dtype` must be one of {', '.join(KV_DTYPES)}, got {requested!r}")
    if requested != "auto":
        return requested
    return DEFAULT_KV_DTYPE.get(device.split(":", 1)[0], "fp32")


# bytes per element of each KV dtype: the facade sizes pools without importing torch
KV_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def kv_bytes_per_slot(config, device: str, kv_dtype: str) -> int:
    """K and V of one token position, every layer, in the dtype the worker stores them in."""
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * \
        KV_DTYPE_BYTES[resolve_kv_dtype(device, kv_dtype)]


