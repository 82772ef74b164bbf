"""Open a GGUF model: header -> ModelConfig, tensor infos -> zero-copy views of the block bytes.

The header is read by engine/models/gguf_header.py. Here the whole tensor table is checked
before anything is built from it: every tensor's type is one tokentop computes, its bytes lie
in the file where llama.cpp's layout puts them (in table order, each padded to the alignment,
so a wrong type or shape shows as a tensor that does not fill its slot), and its name and
shape are the ones the architecture and the metadata call for, no more and no fewer. A file
that passes runs; one that does not is a one-line ModelError naming the file and what in it
is wrong. The tensor bytes are one read-only-to-disk memmap of the file (copy-on-write, so
torch.from_numpy gets a writable view without copying anything).
"""
from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from engine.errors import ModelError
from engine.models.catalog import file_kind
from engine.models.gguf_header import GGUF_MAGIC, TensorInfo, corrupt, read_header, shown

# Mistral, SmolLM and Llama 3.x are `llama` files; each arch is checked against llama.cpp on
# tiny random files (tests/test_llama_cpp_refs.py).
SUPPORTED_ARCHS = ("qwen2", "qwen3", "llama", "gemma3", "phi3")
# The GGML types the GGUF kernels read in place (engine/models/quant.py, engine/kernels).
KERNEL_TYPES = (T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
# Types a linear layer holds as a dense copy, dequantized once at load (gguf.quants, as ggml
# does): 2 bytes per weight in bf16 (4 in fp32 where bf16 is emulated) instead of 2.6-5 bits.
DENSE_FALLBACK_TYPES = (T.Q4_1, T.Q5_1, T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS)
# Every type tokentop computes: a tensor of another type is refused when the file is opened.
SUPPORTED_TYPES = (T.F32, T.F16, T.BF16, *KERNEL_TYPES, *DENSE_FALLBACK_TYPES)

# Gemma 3 facts GGUF does not store (llama.cpp hard-codes them the same way).
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_SLIDING_PERIOD = 6      # layer i is global when (i + 1) % 6 == 0

@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs to know about the architecture, read from GGUF metadata.

    Norm weights are the multiplier itself for every arch, RMSNorm is x * w: llama.cpp's
    converter folds Gemma's (1 + w) into the file (norm_shift = 1.0). Checked on the real
    Gemma 3 270M: x * w reproduces transformers' greedy text, x * (1 + w) gives garbage.
    """

    arch: str                      # one of SUPPORTED_ARCHS
    name: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int                # rows of token_embd.weight
    context_length: int
    rope_base: float
    rope_local_base: float         # base of sliding-window layers (gemma3: 10000), else rope_base
    rope_scaling: dict[str, Any] | None   # {'type': 'linear', 'factor': 8.0, ...}; gemma3: global layers only
    rope_interleaved: bool         # llama: rotate adjacent pairs (llama.cpp permutes Q/K at conversion);
                                   # qwen2/qwen3/gemma3/phi3: rotate halves (NeoX style)
    norm_eps: float
    qkv_bias: bool
    qk_norm: bool                  # RMSNorm over head_dim of q and k, before rope (gemma3, qwen3)
    fused_qkv: bool                # phi3: one attn_qkv matrix, rows [q | k | v]
    fused_gate_up: bool            # phi3: one ffn_up matrix, rows [gate | up]
    activation: str                # 'silu' | 'gelu_tanh'
    embed_scale: float             # embeddings are multiplied by this (gemma: sqrt(hidden))
    post_norms: bool               # gemma: RMSNorm after attention and after the FFN, before the residual add
    tied_embeddings: bool          # no output.weight: token_embd.weight is the lm_head
    sliding_window: int | None
    sliding_window_pattern: tuple[bool, ...]   # per layer: True = sliding window; () when none
    attn_scale: float
    final_logit_softcap: float | None
    attn_logit_softcap: float | None
    metadata: dict[str, Any] = field(repr=False, compare=False, hash=False)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_window_pattern) and self.sliding_window_pattern[layer]


@dataclass
class TensorData:
    """One tensor's GGUF blocks. shape is in torch order: (out_features, in_features) for matrices."""

    name: str
    ggml_type: T
    shape: tuple[int, ...]
    raw: np.ndarray                # uint8 [*shape[:-1], bytes per row], a view of the file mapping
    source: Path | None = None     # the file it was read from, for messages

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)


class GGUFFile:
    """An opened GGUF model: config, metadata and tensors (zero-copy)."""

    def __init__(self, path: Path, metadata: dict[str, Any], tensors: dict[str, TensorData],
                 config: ModelConfig, data: np.ndarray | None = None):
        self.path = path
        self.metadata = metadata
        self.tensors = tensors
        self.config = config
        self.data = data           # the whole file's mapping, which every tensor views

    def tensor(self, name: str) -> TensorData:
        td = self.tensors.get(name)
        if td is None:
            raise ModelError(
                f"model file {self.path} has no tensor {name!r} (needed by its "
                f"{self.config.arch} architecture): the file is incomplete or was converted for "
                f"another architecture; re-download it or pick another model")
        return td

    def has(self, name: str) -> bool:
        return name in self.tensors

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, arch={self.config.arch}, tensors={len(self.tensors)})"


def load_gguf(path: str | Path) -> GGUFFile:
    path = Path(path)
    with _open_model_file(path) as f:
        size = os.fstat(f.fileno()).st_size
        magic = f.read(len(GGUF_MAGIC))
        if magic != GGUF_MAGIC:
            raise ModelError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}): "
                             f"pass a .gguf model file, e.g. one converted with llama.cpp")
        data = np.memmap(f, mode="c", shape=(size,))
    header = read_header(memoryview(data), path)
    tensors = _tensor_views(path, data, header.tensors, header.data_start, header.alignment)
    config = _model_config(path, header.metadata, tensors)
    _check_tensor_table(path, config, tensors)
    return GGUFFile(path, header.metadata, tensors, config, data)


def _open_model_file(path: Path):
    """The file, opened for reading if it is a regular file (never blocking on a FIFO)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ModelError(f"model file {path} does not exist: check the path, or use a catalog "
                         f"model name such as 'qwen2.5-coder-0.5b'") from None
    except OSError as e:
        raise ModelError(f"cannot open model file {path}: {e.strerror or e}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ModelError(f"{path} is not a regular file (it is {file_kind(mode)}): pass the path of "
                         f"a .gguf model file")
    return os.fdopen(fd, "rb")


# --- tensor table: types, sizes, layout ----------------------------------------------------

def _tensor_views(path: Path, data: np.memmap, infos: list[TensorInfo], data_start: int,
                  alignment: int) -> dict[str, TensorData]:
    """One view per tensor, after checking that its bytes fill its slot of the data section.

    llama.cpp lays the data out in table order, each tensor padded to the alignment, and
    refuses any other layout; so a tensor whose type or shape is wrong in the table does not
    fill the space up to the next tensor, and is named here instead of computing garbage.
    """
    size = data.shape[0]
    tensors = {}
    for i, info in enumerate(infos):
        name = shown(info.name)
        qtype = _tensor_type(path, info)
        block, type_size = GGML_QUANT_SIZES[qtype]
        if any(n < 1 for n in info.ne):
            raise corrupt(path, f"tensor {name} has shape {info.ne[::-1]}, with a dimension of 0")
        shape = tuple(reversed(info.ne)) if info.ne else (1,)
        if shape[-1] % block:
            raise corrupt(path, f"tensor {name} has rows of {shape[-1]} values, not a multiple of the "
                                f"{qtype.name} block size {block}")
        row_bytes = shape[-1] // block * type_size
        n_bytes = math.prod(shape[:-1]) * row_bytes
        if i == 0 and info.offset != 0:   # each later one is checked against the one before it
            raise corrupt(path, f"tensor {name}, the first, starts at data offset {info.offset:,}, not 0")
        start = data_start + info.offset
        if start + n_bytes > size:
            raise corrupt(path, f"tensor {name} needs bytes up to {start + n_bytes:,} but the file has "
                                f"{size:,}", truncated=True)
        end = -(-(info.offset + n_bytes) // alignment) * alignment
        if i + 1 < len(infos) and infos[i + 1].offset != end:
            nxt = infos[i + 1]
            raise corrupt(path, f"tensor {name} ({qtype.name}, shape {shape}) takes {n_bytes:,} bytes from "
                                f"data offset {info.offset:,}, so the next tensor, {shown(nxt.name)}, "
                                f"should start at {end:,}, not {nxt.offset:,}: the type or shape of "
                                f"{name}, or the offset of the next, is wrong")
        raw = data[start:start + n_bytes].reshape(*shape[:-1], row_bytes)
        tensors[info.name] = TensorData(info.name, qtype, shape, raw, path)
    return tensors


def _tensor_type(path: Path, info: TensorInfo) -> T:
    try:
        qtype = T(info.ggml_type)
    except ValueError:
        raise ModelError(f"{path}: tensor {shown(info.name)} has unknown GGML type {info.ggml_type}: the "
                         f"file is corrupt, or needs a newer reader than tokentop's") from None
    if qtype not in SUPPORTED_TYPES:
        raise ModelError(f"{path}: tensor {shown(info.name)} is stored as {qtype.name}, which tokentop "
                         f"cannot compute (supported: {', '.join(t.name for t in SUPPORTED_TYPES)}); "
                         f"use a GGUF quantized to one of those types")
    return qtype


# --- config --------------------------------------------------------------------------------

_REQUIRED = object()
# tensors of each layer that every architecture has (qkv biases, QK-norms and post norms vary)
_LAYER_CORE = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
               "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
# phi3 stores q/k/v as one matrix and gate/up as one
_PHI3_LAYER_CORE = ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down")


def _layer_core(arch: str) -> tuple[str, ...]:
    return _PHI3_LAYER_CORE if arch == "phi3" else _LAYER_CORE


class _Metadata:
    """Typed reads of one architecture's keys: a missing, mistyped or out-of-range value is a
    ModelError naming the file and the key, before anything is built from it."""

    def __init__(self, path: Path, md: dict[str, Any], arch: str):
        self.path, self.md, self.arch = path, md, arch

    def raw(self, key: str, default: Any = _REQUIRED) -> Any:
        full = f"{self.arch}.{key}"
        if full in self.md:
            return self.md[full]
        if default is _REQUIRED:
            raise ModelError(f"{self.path}: required metadata key {full!r} is missing; the file is "
                             f"incomplete or from an incompatible converter: re-convert it with a "
                             f"recent llama.cpp convert_hf_to_gguf.py")
        return default

    def bad(self, key: str, value: Any, expected: str) -> ModelError:
        return ModelError(f"{self.path}: metadata {self.arch}.{key} is {shown(value)}, but it must be "
                          f"{expected}; the file is corrupt or from an incompatible converter")

    def has(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self.md

    def integer(self, key: str, default: Any = _REQUIRED) -> Any:
        """A whole number >= 1 (`default` when the key is absent and a default is given)."""
        if default is not _REQUIRED and not self.has(key):
            return default
        v = self.raw(key)
        if type(v) is not int or v < 1:
            raise self.bad(key, v, "a whole number of at least 1")
        return v

    def number(self, key: str, default: Any = _REQUIRED) -> Any:
        """A finite number > 0, as a float."""
        if default is not _REQUIRED and not self.has(key):
            return default
        v = self.raw(key)
        if type(v) not in (int, float) or not (math.isfinite(v) and v > 0):
            raise self.bad(key, v, "a finite number above 0")
        return float(v)

    def per_model(self, key: str, n_layers: int, default: Any = _REQUIRED) -> int:
        """A whole number >= 1, written once or (by some converters) once per layer."""
        if default is not _REQUIRED and not self.has(key):
            return default
        v = self.raw(key)
        if isinstance(v, list):
            if len(v) != n_layers or any(type(x) is not int or x < 1 for x in v):
                raise self.bad(key, v, f"a whole number of at least 1, or {n_layers} of them (one a layer)")
            if len(set(v)) != 1:
                raise ModelError(f"{self.path}: {self.arch}.{key} differs between layers ({shown(v)}); "
                                 f"models with per-layer head counts are not supported")
            return v[0]
        return self.integer(key)


def _model_config(path: Path, md: dict[str, Any], tensors: dict[str, TensorData]) -> ModelConfig:
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelError(f"{path}: architecture {shown(arch)} is not supported; supported architectures "
                         f"are {', '.join(SUPPORTED_ARCHS)}")
    m = _Metadata(path, md, arch)
    gemma, phi3 = arch == "gemma3", arch == "phi3"
    n_layers = m.integer("block_count")
    core = _layer_core(arch)
    if n_layers * len(core) > len(tensors):   # checked before anything is made per layer
        raise ModelError(f"{path}: metadata {arch}.block_count is {n_layers:,}, but the file holds "
                         f"{len(tensors)} tensors, too few for that many layers ({len(core)} "
                         f"or more each): the file is corrupt")
    hidden = m.integer("embedding_length")
    n_heads = m.per_model("attention.head_count", n_layers)
    n_kv_heads = m.per_model("attention.head_count_kv", n_layers, n_heads)
    if n_heads % n_kv_heads:
        raise m.bad("attention.head_count_kv", n_kv_heads, f"a divisor of the head count ({n_heads})")
    head_dim = _head_dim(m, hidden, n_heads)
    rope_base = m.number("rope.freq_base", 10000.0)

    if phi3:
        _refuse_longrope(path, tensors)
    sliding_window, pattern = _sliding(m, n_layers, arch)
    embd = tensors.get("token_embd.weight")
    name = md.get("general.name")
    return ModelConfig(
        arch=arch,
        name=name if isinstance(name, str) else path.stem,
        n_layers=n_layers,
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=m.integer("feed_forward_length"),
        vocab_size=embd.shape[0] if embd is not None else 0,   # no token_embd: refused by the table check
        context_length=m.integer("context_length"),
        rope_base=rope_base,
        rope_local_base=GEMMA3_LOCAL_ROPE_BASE if gemma else rope_base,
        rope_scaling=_rope_scaling(m),
        rope_interleaved=arch == "llama",
        norm_eps=m.number("attention.layer_norm_rms_epsilon"),
        # architecture facts, so that a file missing such a tensor fails at load time
        qkv_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        qk_norm=gemma or arch == "qwen3" or "blk.0.attn_q_norm.weight" in tensors,
        fused_qkv=phi3,
        fused_gate_up=phi3,
        activation="gelu_tanh" if gemma else "silu",
        embed_scale=math.sqrt(hidden) if gemma else 1.0,
        post_norms=gemma or "blk.0.post_attention_norm.weight" in tensors,
        tied_embeddings="output.weight" not in tensors,
        sliding_window=sliding_window,
        sliding_window_pattern=pattern,
        # Gemma 3 uses query_pre_attn_scalar**-0.5, which equals head_dim**-0.5 for every size but
        # 27B; GGUF stores it only as attention.scale when it differs (llama.cpp does the same).
        attn_scale=m.number("attention.scale", head_dim ** -0.5),
        final_logit_softcap=m.number("final_logit_softcapping", None),
        attn_logit_softcap=m.number("attn_logit_softcapping", None),
        metadata=md,
    )


def _refuse_longrope(path: Path, tensors: dict[str, TensorData]) -> None:
    """Phi-3's 128k variants switch rope factors with the context length (LongRoPE): not run."""
    if "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
        raise ModelError(f"{path}: this phi3 model uses LongRoPE (tensors rope_factors_long/short, "
                         f"the 128k-context variants), which tokentop does not run; use a 4k-context "
                         f"Phi-3 GGUF (e.g. Phi-3-mini-4k-instruct)")


def _head_dim(m: _Metadata, hidden: int, n_heads: int) -> int:
    """The size of a head, which the rotary embedding turns whole."""
    head_dim = m.integer("attention.key_length", None)
    if head_dim is None:
        if hidden % n_heads:
            raise m.bad("attention.head_count", n_heads, f"a divisor of embedding_length ({hidden}) "
                                                         f"when attention.key_length is absent")
        head_dim = hidden // n_heads
    if head_dim % 2:
        raise ModelError(f"{m.path}: heads of {head_dim} dimensions ({m.arch}.attention.key_length or "
                         f"embedding_length / head_count) cannot be rotated in pairs; the file is corrupt")
    rope_dims = m.integer("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise m.bad("rope.dimension_count", rope_dims, f"the head size {head_dim} (rotary over part "
                                                      f"of a head is not supported)")
    return head_dim


def _rope_scaling(m: _Metadata) -> dict | None:
    scaling_type = m.raw("rope.scaling.type", None)
    if scaling_type is not None and not isinstance(scaling_type, str):
        raise m.bad("rope.scaling.type", scaling_type, "a name such as 'linear'")
    if scaling_type in (None, "none"):
        return None
    rope_scaling = {"type": scaling_type, "factor": m.number("rope.scaling.factor", 1.0)}
    original = m.integer("rope.scaling.original_context_length", None)
    if original is not None:
        rope_scaling["original_context_length"] = original
    return rope_scaling


def _sliding(m: _Metadata, n_layers: int, arch: str) -> tuple[int | None, tuple[bool, ...]]:
    """The sliding window and the layers it applies to. llama.cpp runs phi3 without its window
    (llama.cpp#13676): so does tokentop, to match it."""
    window = None if arch == "phi3" else m.integer("attention.sliding_window", None)
    return window, (_sliding_pattern(m, n_layers, arch == "gemma3") if window is not None else ())


def _sliding_pattern(m: _Metadata, n_layers: int, gemma: bool) -> tuple[bool, ...]:
    """Which layers attend through the sliding window: listed per layer, or every layer but each
    period-th (Gemma 3's default), or all."""
    key = "attention.sliding_window_pattern"
    raw_pattern = m.raw(key, None)
    if isinstance(raw_pattern, list):
        if len(raw_pattern) != n_layers or any(type(p) not in (bool, int) for p in raw_pattern):
            raise m.bad(key, raw_pattern, f"a period, or one true/false for each of the {n_layers} layers")
        return tuple(bool(p) for p in raw_pattern)
    if raw_pattern is not None or gemma:
        period = m.integer(key, GEMMA3_SLIDING_PERIOD)
        return tuple((i + 1) % period != 0 for i in range(n_layers))
    return (True,) * n_layers


# --- the tensor table against the architecture ---------------------------------------------

def expected_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder reads, with its shape (torch order), in the order of the
    names a message about missing tensors lists first."""
    c = config
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    matrix = {"attn_q": (q, c.hidden), "attn_k": (kv, c.hidden), "attn_v": (kv, c.hidden),
              "attn_qkv": (q + 2 * kv, c.hidden), "attn_output": (c.hidden, q),
              "ffn_gate": (c.ffn_dim, c.hidden), "ffn_down": (c.hidden, c.ffn_dim),
              "ffn_up": ((2 if c.fused_gate_up else 1) * c.ffn_dim, c.hidden)}
    per_layer = {f"{n}.weight": matrix.get(n, (c.hidden,)) for n in _layer_core(c.arch)}
    if c.qk_norm:
        per_layer |= {"attn_q_norm.weight": (c.head_dim,), "attn_k_norm.weight": (c.head_dim,)}
    if c.post_norms:
        per_layer |= {"post_attention_norm.weight": (c.hidden,), "post_ffw_norm.weight": (c.hidden,)}
    if c.qkv_bias:
        per_layer |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
    shapes = {"token_embd.weight": (c.vocab_size, c.hidden), "output_norm.weight": (c.hidden,)}
    if not c.tied_embeddings:
        shapes["output.weight"] = (c.vocab_size, c.hidden)
    for i in range(c.n_layers):
        shapes.update((f"blk.{i}.{n}", s) for n, s in per_layer.items())
    return shapes


def _optional_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Tensors the decoder uses when present: llama 3's rope frequency factors."""
    return {"rope_freqs.weight": (config.head_dim // 2,)}


def _check_tensor_table(path: Path, config: ModelConfig, tensors: dict[str, TensorData]) -> None:
    """Every tensor of the file is one the architecture has, with the shape the metadata calls
    for, and none is missing: checked here, before the first step."""
    c = config
    expected = expected_tensors(c)
    missing = [n for n in expected if n not in tensors]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ModelError(f"model file {path} has no tensor {missing[0]!r}{more} (needed by its "
                         f"{c.arch} architecture): the file is incomplete or was converted for "
                         f"another architecture; re-download it or pick another model")
    optional = _optional_tensors(c)
    unexpected = [n for n in tensors if n not in expected and n not in optional]
    if unexpected:
        more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
        raise ModelError(f"model file {path} has tensor {shown(unexpected[0])}{more}, which a "
                         f"{c.n_layers}-layer {c.arch} model ({c.arch}.block_count = {c.n_layers}) does "
                         f"not have: its metadata and its tensors disagree (a corrupt file, or a "
                         f"variant tokentop does not run)")
    expected |= {n: s for n, s in optional.items() if n in tensors}
    for name, shape in expected.items():
        td = tensors[name]
        if td.shape != shape:
            raise ModelError(f"{path} is inconsistent: tensor {name!r} has shape {td.shape} but the "
                             f"metadata implies {shape}; the file is corrupt or was converted with a "
                             f"broken tool")
    tokens = c.metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
        return
    if not isinstance(tokens, list) or not tokens or not isinstance(tokens[0], str):
        raise ModelError(f"{path}: metadata tokenizer.ggml.tokens is {shown(tokens)}, not a list of "
                         f"strings; the file is corrupt")
    if len(tokens) != c.vocab_size:
        raise ModelError(f"{path}: the vocabulary (tokenizer.ggml.tokens) has {len(tokens):,} entries "
                         f"but token_embd.weight has {c.vocab_size:,} rows; the file is corrupt")
