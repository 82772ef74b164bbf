"""The per-layer work around the linear layers, as one call per stretch of elementwise code.

`FUSED` runs the C++ ops of engine/kernels/fused_ops.cpp (built with the quantized kernels);
`TORCH` is the plain torch definition of the same functions: the fallback without a compiler
(or on CUDA), and the reference the tests hold the C++ ops to. A decode step of the 0.5B ran
about 40 small torch ops per layer; the fused path runs four, plus the four linear layers.
Both compute each row on its own, so neither makes a row depend on its batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import kernels

ACTIVATIONS = ("silu", "gelu_tanh")   # the act_mul op's `act` index


class TorchOps:
    """Plain torch: what the fused ops compute."""

    name = "torch"

    @staticmethod
    def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
        """x += delta (in place, when given); returns rms_norm(x) * w."""
        if delta is not None:
            x.add_(delta)
        return F.rms_norm(x, w.shape, w, eps)

    @staticmethod
    def act_mul(gate_up: torch.Tensor, act: int) -> torch.Tensor:
        """act(gate) * up for rows [gate | up] of width 2F."""
        gate, up = gate_up.chunk(2, dim=-1)
        g = F.silu(gate) if ACTIVATIONS[act] == "silu" else F.gelu(gate, approximate="tanh")
        return g * up

    @staticmethod
    def rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qk_norm: torch.Tensor | None,
                      eps: float, q_scale: float, n_heads: int, n_kv: int, interleaved: bool,
                      k_store: torch.Tensor, v_store: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """qkv [T, (H + 2 KV) hd] -> q [T, H, hd], rotated and scaled by q_scale; the rotated k and
        v are written to rows `slots` of the stores. cos/sin [T, hd] (sin signed, rope.py)."""
        T, hd = cos.shape
        qk = qkv[:, :(n_heads + n_kv) * hd].view(T, n_heads + n_kv, hd)
        v = qkv[:, (n_heads + n_kv) * hd:].view(T, n_kv, hd)
        if qk_norm is not None:
            qk = F.rms_norm(qk, (hd,), None, eps) * qk_norm
        # one rotation for q and k heads together, q's tables carrying the scale
        c = torch.cat([(cos * q_scale)[:, None].expand(-1, n_heads, -1), cos[:, None].expand(-1, n_kv, -1)], 1)
        s = torch.cat([(sin * q_scale)[:, None].expand(-1, n_heads, -1), sin[:, None].expand(-1, n_kv, -1)], 1)
        swapped = qk.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) if interleaved else qk.roll(hd // 2, dims=-1)
        qk = torch.addcmul(qk * c, swapped, s)
        k_store.index_copy_(0, slots, qk[:, n_heads:].to(k_store.dtype))
        v_store.index_copy_(0, slots, v.to(v_store.dtype))
        return qk[:, :n_heads]

    @staticmethod
    def decode_attention(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, slots: torch.Tensor,
                         lengths: torch.Tensor, softcap: float) -> torch.Tensor:
        """One query row per sequence: q [B, H, hd] over the keys slots[b, :lengths[b]]."""
        B, H, hd = q.shape
        KV = k_store.shape[1]
        out = q.new_empty(B, H * hd)
        for b in range(B):   # row by row, as the C++ op: no row sees its batch-mates' padding
            L = int(lengths[b])
            k = k_store.index_select(0, slots[b, :L]).to(q.dtype)       # [L, KV, hd]
            v = v_store.index_select(0, slots[b, :L]).to(q.dtype)
            qg = q[b].view(KV, H // KV, hd)
            scores = torch.bmm(qg, k.permute(1, 2, 0))                   # [KV, G, L]
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            out[b] = torch.bmm(torch.softmax(scores, dim=-1), v.transpose(0, 1)).reshape(H * hd)
        return out


class FusedOps:
    """The C++ ops (engine/kernels/fused_ops.cpp)."""

    name = "fused"

    @staticmethod
    def add_rms_norm(x, delta, w, eps):
        return torch.ops.tokentop.add_rms_norm(x, delta, w, eps)

    @staticmethod
    def act_mul(gate_up, act):
        return torch.ops.tokentop.act_mul(gate_up, act)

    @staticmethod
    def rope_store_kv(qkv, cos, sin, qk_norm, eps, q_scale, n_heads, n_kv, interleaved, k_store, v_store, slots):
        return torch.ops.tokentop.rope_store_kv(qkv, cos, sin, qk_norm, eps, q_scale, n_heads, n_kv,
                                                interleaved, k_store, v_store, slots)

    @staticmethod
    def decode_attention(q, k_store, v_store, slots, lengths, softcap):
        return torch.ops.tokentop.decode_attention(q, k_store, v_store, slots, lengths, softcap or 0.0)


TORCH, FUSED = TorchOps(), FusedOps()


def ops_for(device: torch.device | str, use_kernels: bool = True) -> TorchOps | FusedOps:
    """The C++ ops on the CPU when the kernel library built (they come with it), else torch."""
    if torch.device(device).type == "cpu" and use_kernels and kernels.available():
        return FUSED
    return TORCH
