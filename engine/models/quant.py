"""GGUF blocks -> torch: exact dequantization, and linear layers that run on the GGUF bytes.

Every kernel type is first unpacked to *codes*: an integer q per weight plus an affine map
per group, w = scale * (q - offset) - minus. Dequantization evaluates that map in fp32 in
ggml's order (bit-exact with gguf.quants.dequantize); it serves embeddings, references and
dense copies. The dense-fallback types (DENSE_FALLBACK_TYPES: Q4_1, Q5_1, Q2_K, Q3_K, IQ4_NL,
IQ4_XS) are dequantized by gguf.quants itself, and their linear layers are dense copies only.

Linear layers over quantized matrices call the C++ op tokentop::qmatmul (engine/kernels),
which reads the mmap'd GGUF blocks themselves: no unpacked or dense copy of a weight exists,
and a decode step reads each weight's stored bits once. Without a C++ compiler (or for
float-typed tensors, or on CUDA) a layer holds a dense dequantized copy instead.

Load-time work is numpy: torch's elementwise CPU ops are far slower at it (their uint8 shifts
are not vectorized, and their OpenMP threads stall when the cores are busy).
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, quants as gguf_quants

from engine import kernels
from engine.cpuinfo import has_flag
from engine.errors import ModelError
from engine.models.gguf import DENSE_FALLBACK_TYPES, KERNEL_TYPES, SUPPORTED_TYPES, TensorData
from engine.trace import get_tracer

# Dequantize about this many weights at a time: bounds peak memory, and temporaries of a
# few MiB are recycled by malloc instead of being fresh (page-faulting) mappings every time.
_CHUNK_WEIGHTS = 1 << 20


@dataclass(frozen=True)
class LinearPolicy:
    """How linear layers store their weights and which kernel a call uses."""

    # dtype of dense forms' activations (the GGUF kernels quantize activations to int8 per
    # 32 values themselves and return fp32)
    activation_dtype: torch.dtype = torch.bfloat16
    # Calls with at least this many rows (tokens in the step) use a dense copy of the weight,
    # which is then kept beside the GGUF bytes. None: the GGUF kernels serve every call and no
    # dense copy exists. See prefill_dense_threshold() for the per-machine choice.
    dense_threshold: int | None = None
    # dtype of the dense copy. None: on CPU with bf16 activations, preferred_dense_dtype()
    # (fp32 where bf16 GEMM is emulated: 4 bytes per weight, but several times faster); else
    # the activation dtype.
    dense_dtype: torch.dtype | None = None
    deterministic: bool = False    # one kernel for every T, so a row never depends on its batch
    device: str = "cpu"
    use_kernels: bool = True       # False: dense torch matmuls only (the no-compiler path)

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
    """bf16 F.linear beats fp32 only with native bf16; where bf16 is emulated (no AVX512_BF16
    or AMX) it runs several times slower than fp32 at batch and prefill sizes."""
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
    if td.ggml_type in DENSE_FALLBACK_TYPES:
        return gguf_quants.dequantize(_blocks(td, rows), td.ggml_type).reshape(-1, td.shape[-1])
    return _dequantize_codes(_unpack(td, rows))


def _as_torch(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(a.shape, dtype=dtype)
    _fill(out, a)
    return out


def _row_chunks(n_rows: int, k: int) -> list[slice]:
    step = max(1, _CHUNK_WEIGHTS // k)
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


# --- modules ----------------------------------------------------------------------------------

@dataclass
class GGUFWeight:
    """One or several GGUF matrices stacked along the output dimension, as the file's bytes."""

    tensors: list[torch.Tensor]    # uint8 views of the mmap'd file, one per matrix
    types: list[int]               # GGML type ids
    rows: list[int]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.tensors)


class QuantLinear(torch.nn.Module):
    """y = x W^T + b with W read from its GGUF bytes (tokentop::qmatmul) and/or a dense copy.

    The GGUF kernel reads 4.5-8.5 bits per weight and serves every call size; it gives each
    row the same bits whatever its batch. A dense copy exists only where the kernel cannot
    run (float-typed tensors, no compiler, CUDA) or where a policy asks for dense GEMM from
    some row count on; switching forms by row count is not batch-invariant, so deterministic
    mode keeps exactly one form.
    """

    def __init__(self, name: str, in_features: int, out_features: int, gguf: GGUFWeight | None,
                 dense: torch.Tensor | None, bias: torch.Tensor | None,
                 dense_threshold: int | None, rowwise: bool):
        super().__init__()
        self.name = name
        self.in_features = in_features
        self.out_features = out_features
        self.gguf = gguf
        self.register_buffer("dense", dense, persistent=False)
        self.register_buffer("bias", bias, persistent=False)           # fp32
        self.register_buffer("dense_bias", None if bias is None or dense is None
                             else bias.to(dense.dtype), persistent=False)
        self.dense_threshold = dense_threshold
        self.rowwise = rowwise     # GEMM may not be batch-invariant; one row per call is
        self.op = name             # trace label, e.g. "attention-qkv" (the decoder names it)
        self.sources: list[TensorData] = []   # the GGUF tensors stacked here (for the self-check)

    @property
    def device(self) -> torch.device:
        return self.dense.device if self.dense is not None else torch.device("cpu")

    @property
    def exact(self) -> bool:
        """Every call computes with fp32 weights and activations (no int8 or bf16 rounding)."""
        return set(self.kernel_forms()) == {"dense-float32"}

    @property
    def small_m(self) -> int:
        """The op's small_m: deterministic mode (rowwise) keeps the tile kernel for every row
        count, since the direct decode kernel's bits differ from the tiles'."""
        return 0 if self.rowwise else -1

    def kernel_forms(self) -> dict[str, int]:
        """Each weight form a call can use, with a row count that selects it. "gguf" is the
        GGUF kernel as one decode row runs it (the direct kernel where the ISA has one),
        "gguf-tiles" the kernel of larger calls when it differs (the panels, on AVX-512 and
        AVX2), "gguf-lanes" AVX2's Q8_0 kernel of 7-8 rows."""
        forms = {}
        if self.gguf is not None and self.kernel_for(1) == "gguf":
            forms["gguf"] = 1
            batch = 0 if self.small_m == 0 or not kernels.direct_rows() else kernels.batch_rows()
            if batch and self.kernel_for(batch) == "gguf":
                forms["gguf-tiles"] = batch
            # Q8_0 at 7-8 rows on AVX2: the row-lane kernel (engine/kernels/quant_avx2_panels.inc)
            lanes = kernels.lane_rows() if batch and T.Q8_0 in self.gguf.types else 0
            if lanes and self.kernel_for(8) == "gguf":
                forms["gguf-lanes"] = 8
        if self.dense is not None:
            rows = max(1, self.dense_threshold or 1)
            if self.kernel_for(rows) == "dense":
                forms[f"dense-{str(self.dense.dtype).removeprefix('torch.')}"] = rows
        return forms

    def kernel_for(self, n_rows: int) -> str:
        if self.gguf is not None and (self.dense is None or self.dense_threshold is None
                                      or n_rows < self.dense_threshold):
            return "gguf"
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
        if self.kernel_for(x.shape[0]) == "gguf":
            g = self.gguf
            y = torch.ops.tokentop.qmatmul(x, g.tensors, g.types, g.rows, self.bias, -1, self.small_m)
        else:
            xd = x.to(self.dense.dtype)
            if self.rowwise and x.shape[0] > 1:
                y = torch.cat([F.linear(row, self.dense, self.dense_bias) for row in xd.split(1)])
            else:
                y = F.linear(xd, self.dense, self.dense_bias)
            y = y.to(x.dtype)
        return y.reshape(*lead, self.out_features)

    def direct_call(self):
        """This layer as a plain function of 2-D x, without nn.Module dispatch and buffer
        lookups (a decode step makes a hundred such calls): the op call _forward makes when
        the GGUF kernel is the only form. None when the layer has other forms."""
        g = self.gguf
        if g is None or self.dense is not None:
            return None
        op, bias, small_m = torch.ops.tokentop.qmatmul.default, self.bias, self.small_m
        return lambda x: op(x, g.tensors, g.types, g.rows, bias, -1, small_m)

    def extra_repr(self) -> str:
        return (f"{self.name}: in={self.in_features}, out={self.out_features}, "
                f"forms={'+'.join(self.kernel_forms())}, dense_threshold={self.dense_threshold}")


def pack_for_batches(model: torch.nn.Module) -> int:
    """Make the packed copies that many-row calls read (AVX-512's panels, made on a
    matrix's first such call) now, at load: else the first prefill or batch pays for the whole
    model (about 0.6 s for the 1.5B on 2 cores). Returns the bytes the copies hold."""
    for layer in model.modules():
        rows = layer.kernel_forms().get("gguf-tiles") if isinstance(layer, QuantLinear) else None
        if rows:
            g = layer.gguf
            torch.ops.tokentop.qmatmul(torch.zeros(rows, layer.in_features), g.tensors, g.types, g.rows,
                                       None, -1, layer.small_m)
    return kernels.packed_bytes()


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
    return bias.detach().reshape(n).to(device=policy.device, dtype=torch.float32)


def _gguf_weight(tds: list[TensorData]) -> GGUFWeight:
    with warnings.catch_warnings():    # a read-only mapping is only ever read here
        warnings.simplefilter("ignore", UserWarning)
        tensors = [torch.from_numpy(np.ascontiguousarray(t.raw)).reshape(-1) for t in tds]
    return GGUFWeight(tensors, [int(t.ggml_type) for t in tds], [t.shape[0] for t in tds])


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

    use_gguf = (policy.use_kernels and all(t.ggml_type in KERNEL_TYPES for t in tds)
                and kernels.available())
    gguf = _gguf_weight(tds) if use_gguf else None
    want_dense = not use_gguf or (policy.dense_threshold is not None and not policy.deterministic)
    dense = None
    if want_dense:
        dense = torch.empty(n, k, dtype=policy.dense_weight_dtype)
        row0 = 0
        for t in tds:
            for rows in _row_chunks(t.shape[0], k):
                _fill(dense[row0 + rows.start:row0 + rows.stop], _dequantize_np(t, rows))
            row0 += t.shape[0]
    # GEMM is not batch-invariant on every CPU (fp32 on AVX2, fp16 on AVX-512 are not);
    # one row per call is, whatever the dtype
    linear = QuantLinear(name, k, n, gguf, dense, bias_t, policy.dense_threshold, policy.deterministic)
    linear.sources = tds
    return linear


def _make_dense_only_linear(name: str, tds: list[TensorData], bias: torch.Tensor | None,
                            policy: LinearPolicy) -> QuantLinear:
    """The CUDA path: dense weights in the activation dtype (dequantized on the CPU, then moved).
    Dense cuBLAS GEMM may change its algorithm with the row count, so deterministic mode
    there is best-effort until measured on a GPU."""
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
