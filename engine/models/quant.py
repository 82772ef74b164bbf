"""GGUF blocks -> torch: exact dequantization, and linear layers that run on the packed weights.

Every supported type is first unpacked to *codes*: an integer q per weight plus an affine map
per group, w = scale * (q - offset) - minus. Dequantization evaluates that map in fp32 in
ggml's order (bit-exact with gguf.quants.dequantize). torch's CPU int4 kernel

    _weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros[K/32, N, 2]):  w = (q4 - 8)*s + z

takes 4-bit codes per 32-element group. Codes wider than 4 bits are split into a low and a
high nibble *plane*, each an int4 matrix; the planes are laid end to end along K and x is
repeated, so one kernel call sums both in fp32 and rounds once (see _int4_planes).

Load-time work is numpy: on this 2-core machine torch's elementwise CPU ops were 5-50x slower
than numpy's (uint8 shifts are not vectorized; OpenMP threads stall when the cores are busy).
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from engine.cpuinfo import cpu_summary, has_flag
from engine.errors import ModelError
from engine.models.gguf import TensorData
from engine.trace import get_tracer

SUPPORTED_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q5_0, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K)
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
# Types whose exact values one int4 g32 kernel call computes (as one or two nibble planes).
# Q6_K has 16-element sub-blocks with their own scales, which group size 32 cannot express,
# so faithful mode keeps it dense.
INT4_EXACT_TYPES = (T.Q4_0, T.Q4_K, T.Q5_0, T.Q5_K, T.Q8_0)
INT4_GROUP = 32
# Unpack / pack about this many weights at a time: bounds peak memory, and temporaries of a
# few MiB are recycled by malloc instead of being fresh (page-faulting) mappings every time.
_CHUNK_WEIGHTS = 1 << 20


@dataclass(frozen=True)
class LinearPolicy:
    """How linear layers store their weights and which kernel a call uses."""

    activation_dtype: torch.dtype = torch.bfloat16
    # Calls with fewer rows (tokens in the step) than this use the int4 kernel, others dense.
    # None: never dense where int4 can hold the weight (and no dense copy is kept).
    # 8 = the crossover measured for the 0.5B on this project's AVX2 EPYC (int4 vs fp32 GEMM).
    dense_threshold: int | None = 8
    # dtype of the dense copy. None: on CPU with bf16 activations, preferred_dense_dtype()
    # (fp32 where bf16 GEMM is emulated: 4 bytes per weight, but 3-6x faster); else the
    # activation dtype.
    dense_dtype: torch.dtype | None = None
    weights: str = "faithful"      # 'faithful' keeps every GGUF value; 'fast' requantizes to int4
    deterministic: bool = False    # one kernel for every T, so a row never depends on its batch
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.weights not in ("faithful", "fast"):
            raise ModelError(f"weights must be 'faithful' or 'fast', got {self.weights!r}")

    @property
    def on_cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"

    @property
    def dense_weight_dtype(self) -> torch.dtype:
        if self.dense_dtype is not None:
            return self.dense_dtype
        if self.activation_dtype == torch.bfloat16 and not self.on_cuda:
            return preferred_dense_dtype()
        return self.activation_dtype


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 GEMM runs natively instead of being emulated."""
    return has_flag("avx512_bf16") or has_flag("amx_bf16")


@functools.cache
def preferred_dense_dtype() -> torch.dtype:
    """Measured on this project's machines: bf16 F.linear beats fp32 only with native bf16;
    on an AVX2-only EPYC it was 3-6x slower than fp32 at 8-64 rows."""
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


# --- codes ------------------------------------------------------------------------------------

@dataclass
class _Codes:
    """w = scale * (q - offset) - minus, per group of `group` consecutive weights of a row."""

    q: np.ndarray                  # uint8 [rows, K]
    scale: np.ndarray              # fp32 [rows, K // group]
    minus: np.ndarray | None       # fp32 [rows, K // group] (K-quants' dmin * m)
    offset: int
    group: int
    bits: int


def _blocks(td: TensorData, rows: slice | None = None) -> np.ndarray:
    raw = td.raw.reshape(-1, td.raw.shape[-1])
    if rows is not None:
        raw = raw[rows]
    return np.ascontiguousarray(raw).reshape(-1, GGML_QUANT_SIZES[td.ggml_type][1])


def _f16(b: np.ndarray) -> np.ndarray:
    """[n, 2] little-endian bytes -> fp32 [n, 1]."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, m] bytes -> [n, 2m]: all low nibbles, then all high nibbles (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 12-byte field -> 8 six-bit scales and 8 six-bit mins per super-block."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _unpack(td: TensorData, rows: slice | None = None) -> _Codes:
    b = _blocks(td, rows)
    n = b.shape[0]
    t = td.ggml_type
    minus = None
    if t == T.Q4_0:
        q, scale, offset, group, bits = _nibbles(b[:, 2:]), _f16(b[:, :2]), 8, 32, 4
    elif t == T.Q5_0:
        q = _nibbles(b[:, 6:]) | (np.unpackbits(b[:, 2:6], axis=1, bitorder="little") << 4)
        scale, offset, group, bits = _f16(b[:, :2]), 16, 32, 5
    elif t == T.Q8_0:
        q = b[:, 2:] ^ 0x80        # int8 + 128 as uint8: two's complement with the sign bit flipped
        scale, offset, group, bits = _f16(b[:, :2]), 128, 32, 8
    elif t in (T.Q4_K, T.Q5_K):
        sc, mn = _k_scale_min(b[:, 4:16])
        scale, minus = _f16(b[:, 0:2]) * sc, _f16(b[:, 2:4]) * mn
        qs = b[:, 16:] if t == T.Q4_K else b[:, 48:]
        q = ((qs.reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, 8, 32)
        if t == T.Q5_K:
            q = q | (((b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1) << 4)
        offset, group, bits = 0, 32, 4 if t == T.Q4_K else 5
    elif t == T.Q6_K:
        ql = (b[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        qh = (b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        q = ql.reshape(n, 8, 32) | (qh.reshape(n, 8, 32) << 4)
        scale = _f16(b[:, 208:210]) * np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
        offset, group, bits = 32, 16, 6
    else:
        raise _unsupported(td)
    k = td.shape[-1]
    n_rows = q.size // k
    return _Codes(q.reshape(n_rows, k), scale.reshape(n_rows, k // group),
                  None if minus is None else minus.reshape(n_rows, k // group), offset, group, bits)


def _unsupported(td: TensorData) -> ModelError:
    names = ", ".join(t.name for t in SUPPORTED_TYPES)
    return ModelError(f"tensor {td.name!r} has type {td.ggml_type.name}, which tokentop cannot "
                      f"load (supported: {names}); use a GGUF quantized to one of those types")


# --- dequantization ---------------------------------------------------------------------------

def _dequantize_codes(c: _Codes) -> np.ndarray:
    """fp32 [rows, K]: scale * (q - offset) - minus, in ggml's order (in place: fewer pages)."""
    rows, k = c.q.shape
    w = c.q.reshape(rows, -1, c.group).astype(np.float32)
    w -= c.offset
    w *= c.scale[:, :, None]
    if c.minus is not None:
        w -= c.minus[:, :, None]
    return w.reshape(rows, k)


def _dequantize_np(td: TensorData, rows: slice | None = None) -> np.ndarray:
    if td.ggml_type == T.F32:
        return _blocks(td, rows).view(np.float32).reshape(-1, td.shape[-1])
    if td.ggml_type == T.F16:
        return _blocks(td, rows).view(np.float16).astype(np.float32).reshape(-1, td.shape[-1])
    if td.ggml_type == T.BF16:
        bits = _blocks(td, rows).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(-1, td.shape[-1])
    return _dequantize_codes(_unpack(td, rows))


def _round_np(a: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """fp32 values rounded (nearest even) to `dtype`'s precision, still as fp32."""
    if dtype == torch.float32:
        return a
    if dtype == torch.float16:
        return a.astype(np.float16).astype(np.float32)
    if dtype == torch.bfloat16:
        u = a.astype(np.float32).view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    raise ModelError(f"activation dtype {dtype} is not supported (use bf16, fp16 or fp32)")


def _as_torch(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(a.shape, dtype=dtype)
    _fill(out, a)
    return out


def _row_chunks(n_rows: int, k: int) -> list[slice]:
    """Row ranges of about _CHUNK_WEIGHTS weights, each a whole number of int4 row blocks:
    packing pieces and concatenating them equals packing the whole matrix only then."""
    block = int4_row_block()
    step = max(block, _CHUNK_WEIGHTS // k // block * block)
    return [slice(a, min(a + step, n_rows)) for a in range(0, n_rows, step)]


def _check_supported(td: TensorData) -> None:
    if td.ggml_type not in SUPPORTED_TYPES:
        raise _unsupported(td)


def dequantize(td: TensorData, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """All values of a tensor as `dtype` (computed in fp32, as ggml does), shape td.shape."""
    _check_supported(td)
    n_rows = math.prod(td.shape[:-1])
    out = torch.empty(n_rows, td.shape[-1], dtype=dtype)
    for rows in _row_chunks(n_rows, td.shape[-1]):
        _fill(out[rows], _dequantize_np(td, rows))
    return out.reshape(td.shape)


def _fill(out: torch.Tensor, w: np.ndarray) -> None:
    """out[:] = w, rounding fp32 to out's dtype to nearest even (torch's .to does the same)."""
    with warnings.catch_warnings():   # w may be a read-only view of the file: only read here
        warnings.simplefilter("ignore", UserWarning)
        out.copy_(torch.from_numpy(w))


def dequantize_rows(td: TensorData, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows `ids` of a 2-D tensor, dequantized (an embedding lookup that never expands the table)."""
    _check_supported(td)
    picked = TensorData(td.name, td.ggml_type, (int(ids.numel()), td.shape[-1]),
                        td.raw[ids.reshape(-1).cpu().numpy()])
    return _as_torch(_dequantize_np(picked), dtype).view(*ids.shape, td.shape[-1])


# --- int4 planes ------------------------------------------------------------------------------

# One int4 matrix (or a row block of it): codes 0..15 [rows, P*K], scales and zeros
# [rows, P*K/32] as fp32 already rounded to the activation dtype.
_Int4Part = tuple[np.ndarray, np.ndarray, np.ndarray]


def _int4_planes(c: _Codes, dtype: torch.dtype) -> _Int4Part:
    """Exact nibble planes of codes.

    Scales are rounded to `dtype` (the kernel's, e.g. bf16) and zeros are derived from the
    rounded scales, so the only loss is that rounding. Every zero below is the rounded scale
    times a power of two (exact), except K-quants' 8*s - dmin*m, which is rounded once more.
    """
    s = _round_np(c.scale, dtype)
    minus = c.minus if c.minus is not None else np.float32(0)
    if c.bits == 4:
        # w = s*(q - offset) - minus = (q - 8)*s + [(8 - offset)*s - minus]
        return c.q, s, _round_np((8 - c.offset) * s - minus, dtype)
    # q = 16*hi + lo.  hi plane: (hi - 8)*16s + z_hi;  lo plane: (lo - 8)*s + z_lo;
    # constants must add up to -offset*s - minus:  z_hi + z_lo = (136 - offset)*s - minus.
    # Q5_0 (offset 16): z_hi = 128s, z_lo = -8s.  Q8_0 (128): z_hi = 0, z_lo = 8s.
    # Q5_K (0): z_hi = 128s, z_lo = 8s - minus.
    z_hi = 128 * s if c.offset < 128 else np.zeros_like(s)
    z_lo = _round_np((136 - c.offset) * s - z_hi - minus, dtype)
    return (np.concatenate([c.q & 0x0F, c.q >> 4], axis=1),
            np.concatenate([s, 16 * s], axis=1), np.concatenate([z_lo, z_hi], axis=1))


def _requantize_int4(w: np.ndarray, dtype: torch.dtype) -> _Int4Part:
    """'fast' mode: any fp32 [rows, K] -> one int4 plane, min/max per 32-group (lossy)."""
    g = w.reshape(w.shape[0], -1, INT4_GROUP)
    lo, hi = g.min(-1), g.max(-1)
    s = _round_np((hi - lo) / 15, dtype)
    z = _round_np(lo + 8 * s, dtype)
    inv = np.divide(1, s, out=np.zeros_like(s), where=s > 0)
    q = np.rint((g - z[..., None]) * inv[..., None]) + 8
    return np.clip(q, 0, 15).astype(np.uint8).reshape(w.shape), s, z


def _int4_planes_of(td: TensorData, policy: LinearPolicy) -> int:
    """How many int4 planes hold td under `policy`; 0 where it stays dense."""
    if len(td.shape) != 2 or td.shape[1] % INT4_GROUP or policy.on_cuda:
        return 0
    t = td.ggml_type
    if t in (T.Q4_0, T.Q4_K):
        return 1
    if t in INT4_EXACT_TYPES and policy.weights == "faithful":
        return 2
    return 1 if policy.weights == "fast" and t not in FLOAT_TYPES else 0


def _int4_part(td: TensorData, rows: slice, policy: LinearPolicy, codes: _Codes | None) -> _Int4Part:
    """Rows of a tensor as int4 planes (exact) or, in 'fast' mode, requantized to one plane."""
    if _int4_planes_of(td, policy) == 2 or td.ggml_type in (T.Q4_0, T.Q4_K):
        return _int4_planes(codes if codes is not None else _unpack(td, rows), policy.activation_dtype)
    w = _dequantize_codes(codes) if codes is not None else _dequantize_np(td, rows)
    return _requantize_int4(w, policy.activation_dtype)


@dataclass
class Int4Weight:
    """A linear weight in torch's CPU int4 layout: `planes` copies of x are fed along K."""

    packed: torch.Tensor           # uint8, packed [n_padded, planes*K]
    scales_zeros: torch.Tensor     # [planes*K/32, n_padded, 2] in the activation dtype
    planes: int
    out_features: int              # real N; rows beyond it (padding to a row block) are zero weights

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.scales_zeros.dtype          # the kernel wants x in its scales' dtype
        xk = x.to(dtype)
        xk = xk.contiguous() if self.planes == 1 else xk.repeat(1, self.planes)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xk, self.packed, INT4_GROUP, self.scales_zeros)
        return (y if y.shape[1] == self.out_features else y[:, :self.out_features]).to(x.dtype)


def _widen(part: _Int4Part, k: int, planes: int) -> _Int4Part:
    """Append zero-weight planes (q4 = 8, s = z = 0) so stacked tensors share one plane count."""
    q, s, z = part
    extra = planes * k - q.shape[1]
    if extra == 0:
        return part
    pad = np.zeros((s.shape[0], extra // INT4_GROUP), np.float32)
    return (np.concatenate([q, np.full((q.shape[0], extra), 8, np.uint8)], axis=1),
            np.concatenate([s, pad], axis=1), np.concatenate([z, pad], axis=1))


def _pack_rows_np(q: np.ndarray, block: int) -> np.ndarray:
    """torch's CPU int4 layout, in numpy: per block of `block` rows, for each k, byte j holds
    row j (low nibble) and row j + block/2 (high nibble). About 10x faster than the torch op."""
    n, k = q.shape
    b = q.reshape(n // block, 2, block // 2, k)
    return (b[:, 0] | (b[:, 1] << 4)).transpose(0, 2, 1).reshape(n, k // 2)


def _pack_rows_torch(q: np.ndarray) -> np.ndarray:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.from_numpy(q.astype(np.int32)), 1).numpy()


_PROBE_ROWS = 512


@functools.cache
def int4_row_block() -> int:
    """Rows per block of torch's CPU int4 layout on this CPU (32 on AVX2, 64 on AVX-512 today).

    Learned, not assumed: a probe is packed whole and in pieces of 16, 32, 64, ... rows; the
    smallest piece whose concatenation equals the whole is the block. Chunked packing and
    the padding of N must be whole multiples of it.
    """
    q = np.random.default_rng(0).integers(0, 16, (_PROBE_ROWS, 64), dtype=np.uint8)
    whole = _pack_rows_torch(q)
    block = 16                              # torch refuses N that is not a multiple of 16
    while block < _PROBE_ROWS:
        try:
            pieces = [_pack_rows_torch(q[a:a + block]) for a in range(0, _PROBE_ROWS, block)]
            if np.array_equal(np.concatenate(pieces), whole):
                return block
        except RuntimeError:                # a piece size this torch refuses: not the block
            pass
        block *= 2
    return _PROBE_ROWS


@functools.cache
def _pack_rows() -> Callable[[np.ndarray], np.ndarray]:
    """The numpy packer if it reproduces this torch build's layout, else torch's own op."""
    block = int4_row_block()
    q = np.random.default_rng(1).integers(0, 16, (2 * block, 64), dtype=np.uint8)
    if np.array_equal(_pack_rows_np(q, block), _pack_rows_torch(q)):
        return functools.partial(_pack_rows_np, block=block)
    return _pack_rows_torch


class _Int4Packer:
    """Packs int4 row blocks as they are produced, so no whole-matrix temporary exists."""

    def __init__(self, n: int, k: int, planes: int):
        self.n, self.k, self.planes = n, k, planes
        self.block = int4_row_block()
        n_pad = -(-n // self.block) * self.block   # whole row blocks; padding rows are zero weights
        self.packed = np.empty((n_pad, planes * k // 2), np.uint8)
        self.s = np.zeros((n_pad, planes * k // INT4_GROUP), np.float32)
        self.z = np.zeros_like(self.s)
        self.rows = self.done = 0
        self.pending = np.empty((0, planes * k), np.uint8)
        self.pack = _pack_rows()

    def add(self, part: _Int4Part) -> None:
        q, s, z = _widen(part, self.k, self.planes)
        self.s[self.rows:self.rows + len(q)] = s
        self.z[self.rows:self.rows + len(q)] = z
        self.rows += len(q)
        self._pack(np.concatenate([self.pending, q]) if len(self.pending) else q)

    def _pack(self, q: np.ndarray) -> None:
        take = len(q) // self.block * self.block
        self.packed[self.done:self.done + take] = self.pack(q[:take])
        self.done, self.pending = self.done + take, q[take:]

    def finish(self, dtype: torch.dtype) -> Int4Weight:
        if self.rows != self.n:
            raise AssertionError(f"packed {self.rows} rows of {self.n}")
        pad = len(self.packed) - self.n
        if pad:
            self._pack(np.concatenate([self.pending, np.full((pad, self.planes * self.k), 8, np.uint8)]))
        scales_zeros = _as_torch(np.stack([self.s.T, self.z.T], axis=-1), dtype)
        return Int4Weight(torch.from_numpy(self.packed), scales_zeros, self.planes, self.n)


# --- modules ----------------------------------------------------------------------------------

class QuantLinear(torch.nn.Module):
    """y = x W^T + b with W kept as int4 planes and/or dense; the kernel is chosen per call.

    Holding both forms lets small steps (decode) use the int4 kernel, which reads 4-8 bits per
    weight, and large steps (prefill) use dense GEMM, which is faster there. Each kernel alone
    gives a row the same bits whatever its batch; switching kernels does not, which is why
    deterministic mode keeps exactly one form.
    """

    def __init__(self, name: str, in_features: int, out_features: int, int4: Int4Weight | None,
                 dense: torch.Tensor | None, bias: torch.Tensor | None,
                 dense_threshold: int | None, rowwise: bool):
        super().__init__()
        self.name = name
        self.in_features = in_features
        self.out_features = out_features
        self.int4 = int4
        self.register_buffer("dense", dense, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.register_buffer("dense_bias", None if bias is None or dense is None
                             else bias.to(dense.dtype), persistent=False)
        self.dense_threshold = dense_threshold
        self.rowwise = rowwise     # GEMM may not be batch-invariant; one row per call is
        self.op = name             # trace label, e.g. "attention-qkv" (the decoder names it)
        self.sources: list[TensorData] = []   # the GGUF tensors stacked here (for the self-check)

    def kernel_forms(self) -> dict[str, int]:
        """Each weight form a call can use, with a row count that selects it."""
        forms = {}
        if self.int4 is not None and self.kernel_for(1) == "int4":
            forms[f"int4x{self.int4.planes}"] = 1
        if self.dense is not None:
            rows = max(1, self.dense_threshold or 1)
            if self.kernel_for(rows) == "dense":
                forms[f"dense-{str(self.dense.dtype).removeprefix('torch.')}"] = rows
        return forms

    def kernel_for(self, n_rows: int) -> str:
        if self.int4 is not None and (self.dense is None or self.dense_threshold is None
                                      or n_rows < self.dense_threshold):
            return "int4"
        return "dense"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tracer = get_tracer()
        if not tracer.active:
            return self._forward(x)
        with tracer.scope("qmatmul", op=self.op, kernel=self.kernel_for(x.numel() // self.in_features)):
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        if self.kernel_for(x.shape[0]) == "int4":
            y = self.int4.matmul(x)
            if self.bias is not None:
                y = y + self.bias
        else:
            xd = x.to(self.dense.dtype)
            if self.rowwise and x.shape[0] > 1:
                y = torch.cat([F.linear(row, self.dense, self.dense_bias) for row in xd.split(1)])
            else:
                y = F.linear(xd, self.dense, self.dense_bias)
            y = y.to(x.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        forms = [f for f, w in (("int4", self.int4), ("dense", self.dense)) if w is not None]
        planes = f", planes={self.int4.planes}" if self.int4 is not None else ""
        return (f"{self.name}: in={self.in_features}, out={self.out_features}, "
                f"forms={'+'.join(forms)}{planes}, dense_threshold={self.dense_threshold}")


def _bias_tensor(bias: torch.Tensor | TensorData | Sequence[TensorData] | None, name: str, n: int,
                 policy: LinearPolicy) -> torch.Tensor | None:
    if bias is None:
        return None
    if isinstance(bias, TensorData):
        bias = dequantize(bias)
    elif not isinstance(bias, torch.Tensor):
        bias = torch.cat([dequantize(b).reshape(-1) for b in bias])
    if bias.numel() != n:
        raise ModelError(f"bias for {name} has {bias.numel()} values, expected {n}: the model "
                         f"file is corrupt")
    return bias.detach().reshape(n).to(device=policy.device, dtype=policy.activation_dtype)


def make_linear(td: TensorData | Sequence[TensorData], *,
                bias: torch.Tensor | TensorData | Sequence[TensorData] | None,
                policy: LinearPolicy) -> QuantLinear:
    """A linear layer over one GGUF matrix, or several stacked along the output dimension
    (e.g. q/k/v or gate/up fused into one call). `bias` covers all stacked outputs: a tensor,
    or the GGUF bias tensor(s) in the same order."""
    tds = [td] if isinstance(td, TensorData) else list(td)
    for t in tds:
        _check_supported(t)
        if len(t.shape) != 2 or t.shape[1] != tds[0].shape[1]:
            raise ModelError(f"tensor {t.name!r} has shape {t.shape}; a linear layer needs "
                             f"matrices with {tds[0].shape[1]} inputs: the model file is corrupt")
    name = "+".join(t.name for t in tds)
    k, n = tds[0].shape[1], sum(t.shape[0] for t in tds)
    bias_t = _bias_tensor(bias, name, n, policy)
    if policy.on_cuda:
        return _make_dense_only_linear(name, tds, bias_t, policy)

    act, threshold = policy.activation_dtype, policy.dense_threshold
    planes = [_int4_planes_of(t, policy) for t in tds]
    want_int4 = min(planes) > 0 and (threshold is None or threshold > 1)
    want_dense = not want_int4 or not (policy.deterministic or threshold is None)
    packer = _Int4Packer(n, k, max(planes)) if want_int4 else None
    dense = torch.empty(n, k, dtype=policy.dense_weight_dtype) if want_dense else None
    row0 = 0
    for t in tds:
        for rows in _row_chunks(t.shape[0], k):
            # unpack once per chunk for both forms
            codes = _unpack(t, rows) if t.ggml_type not in FLOAT_TYPES else None
            if packer is not None:
                packer.add(_int4_part(t, rows, policy, codes))
            if dense is not None:
                w = _dequantize_codes(codes) if codes is not None else _dequantize_np(t, rows)
                _fill(dense[row0 + rows.start:row0 + rows.stop], w)
        row0 += t.shape[0]
    int4 = packer.finish(act) if packer is not None else None
    # GEMM is not batch-invariant on every CPU (fp32 on AVX2, fp16 on AVX-512 were not);
    # one row per call is, whatever the dtype
    rowwise = policy.deterministic
    linear = QuantLinear(name, k, n, int4, dense, bias_t, threshold, rowwise)
    linear.sources = tds
    return linear


def _make_dense_only_linear(name: str, tds: list[TensorData], bias: torch.Tensor | None,
                            policy: LinearPolicy) -> QuantLinear:
    """The CUDA path: dense weights in the activation dtype (dequantized on the CPU, then moved).

    torch's CUDA int4 kernel (_weight_int4pack_mm) wants another packing and is not wired up
    yet. Dense cuBLAS GEMM may change its algorithm with the row count, so deterministic mode
    there is best-effort until measured on a GPU.
    """
    dense = torch.cat([dequantize(t, policy.dense_weight_dtype) for t in tds]).to(policy.device)
    linear = QuantLinear(name, tds[0].shape[1], dense.shape[0], None, dense, bias,
                         policy.dense_threshold, rowwise=False)
    linear.sources = tds
    return linear


class QuantEmbedding(torch.nn.Module):
    """Token embedding read from the GGUF blocks: only the looked-up rows are dequantized,
    so the (151,936- or 262,144-row) table never exists in fp32."""

    def __init__(self, td: TensorData, dtype: torch.dtype, device: str):
        super().__init__()
        _check_supported(td)
        self.td = td
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = td.shape
        # On CUDA a host gather per step would force a sync: keep the table on the device.
        on_cuda = torch.device(device).type == "cuda"
        self.register_buffer("table", dequantize(td, dtype).to(device) if on_cuda else None,
                             persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return F.embedding(ids, self.table)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range for {self.td.name} ({self.num_embeddings} rows)")
        return dequantize_rows(self.td, ids, self.dtype)


def make_embedding(td: TensorData, *, dtype: torch.dtype = torch.float32,
                   device: str = "cpu") -> QuantEmbedding:
    """Embedding lookup over a GGUF table. For tied embeddings, pass the same TensorData to
    make_linear to get the lm_head."""
    return QuantEmbedding(td, dtype, device)
