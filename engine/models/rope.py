"""Rotary position embedding: cos/sin tables computed once, applied by position lookup.

Two pairings exist in GGUF files. NeoX ("rotate half": dim i pairs with i + d/2) is what
qwen2, qwen3, gemma3 and phi3 use (as llama.cpp runs them). Llama GGUFs are converted with
their Q/K rows permuted so that llama.cpp can use its "normal" rope, where dim 2i pairs with
2i+1 (interleaved).
"""
from __future__ import annotations

import torch

from engine.errors import ModelError


def inverse_frequencies(head_dim: int, base: float, scaling: dict | None,
                        freq_factors: torch.Tensor | None) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequency (fp32, as HF computes it) and the position scale.

    Linear scaling divides positions by the factor; llama3-style scaling arrives in GGUF
    as a `rope_freqs.weight` tensor that divides each frequency.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.float()
    position_scale = 1.0
    kind = (scaling or {}).get("type", "none")
    if kind in ("none", None, ""):
        pass
    elif kind == "linear":
        position_scale = 1.0 / float(scaling["factor"])
    else:
        raise ModelError(f"This model asks for '{kind}' rope scaling, which tokentop does not implement "
                         f"yet (linear and llama3 frequency factors are supported). Use a model without it.")
    return inv_freq, position_scale


class RotaryTable:
    """cos/sin for positions [0, capacity), grown by doubling when a longer position shows up.

    Rotation is x*cos + swap(x)*sin_signed, where swap exchanges the two members of each
    pair and the sign of rotate-half lives in the table (applied by rope_store_kv in
    engine/models/fused.py, with the K/V write).
    """

    def __init__(self, head_dim: int, base: float, *, interleaved: bool = False,
                 scaling: dict | None = None, freq_factors: torch.Tensor | None = None,
                 capacity: int = 4096, device: str | torch.device = "cpu"):
        self.head_dim = head_dim
        self.interleaved = interleaved
        self.inv_freq, self.position_scale = inverse_frequencies(head_dim, base, scaling, freq_factors)
        self.inv_freq = self.inv_freq.to(device)
        self.cos = self.sin_signed = torch.empty(0, device=device)
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        pos = torch.arange(capacity, device=self.inv_freq.device).float() * self.position_scale
        freqs = torch.outer(pos, self.inv_freq)  # [capacity, d/2] fp32, like HF
        cos, sin = freqs.cos(), freqs.sin()
        if self.interleaved:   # pairs (2i, 2i+1) -> (x*c - y*s, y*c + x*s)
            self.cos = cos.repeat_interleave(2, dim=-1)
            self.sin_signed = torch.stack((-sin, sin), dim=-1).flatten(-2)
        else:                  # pairs (i, i+d/2)
            self.cos = torch.cat((cos, cos), dim=-1)
            self.sin_signed = torch.cat((-sin, sin), dim=-1)

    def reserve(self, capacity: int) -> None:
        """Grow now to hold positions [0, capacity): lookups below it then never grow the table."""
        if capacity > self.cos.shape[0]:
            cap = self.cos.shape[0]
            while cap < capacity:
                cap *= 2
            self._grow(cap)

    def lookup(self, positions: torch.Tensor, *, checked: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, head_dim] of each position (contiguous rows). checked=False
        for positions known to lie below the reserved capacity: no host read of their maximum
        (a device sync on CUDA, and not capturable in a CUDA graph)."""
        if checked:
            self.reserve(int(positions.max()) + 1 if positions.numel() else 0)
        return self.cos[positions], self.sin_signed[positions]
