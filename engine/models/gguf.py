"""Read a GGUF file: metadata -> ModelConfig, tensor infos -> zero-copy views of the block bytes.

The header is parsed here rather than with gguf.GGUFReader: the reader builds a numpy view per
array element, which takes tens of seconds over the real models' 151,936 / 262,144 vocabulary
strings; this parser takes well under a second. The gguf package still supplies the type enums and the
block sizes, and the tensor bytes are one read-only-to-disk memmap of the file (copy-on-write,
so torch.from_numpy gets a writable view without copying anything).
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from engine.errors import ModelError

SUPPORTED_ARCHS = ("qwen2", "llama", "gemma3")
GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Gemma 3 facts GGUF does not store (llama.cpp hard-codes them the same way).
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_SLIDING_PERIOD = 6      # layer i is global when (i + 1) % 6 == 0

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "<?",
}
_ARRAY_DTYPES = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.FLOAT64: "<f8",
    GGUFValueType.BOOL: "?",
}


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs to know about the architecture, read from GGUF metadata.

    Norm weights are the multiplier itself for every arch, RMSNorm is x * w: llama.cpp's
    converter folds Gemma's (1 + w) into the file (norm_shift = 1.0). Checked on the real
    Gemma 3 270M: x * w reproduces transformers' greedy text, x * (1 + w) gives garbage.
    """

    arch: str                      # 'qwen2' | 'llama' | 'gemma3'
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
                                   # qwen2/gemma3: rotate halves (NeoX style)
    norm_eps: float
    qkv_bias: bool
    qk_norm: bool                  # RMSNorm over head_dim of q and k (gemma3)
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
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    raw: np.ndarray                # uint8 [*shape[:-1], bytes per row], a view of the file mapping

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
    if not path.exists():
        raise ModelError(f"model file {path} does not exist: check the path, or use a catalog "
                         f"model name such as 'qwen2.5-coder-0.5b'")
    if not path.is_file():
        raise ModelError(f"{path} is not a file: pass the path of a .gguf model file")
    size = path.stat().st_size
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}): "
                         f"pass a .gguf model file, e.g. one converted with llama.cpp")
    data = np.memmap(path, mode="c")
    try:
        metadata, infos, data_start = _parse_header(memoryview(data))
    except (struct.error, IndexError, ValueError, UnicodeDecodeError) as e:
        raise ModelError(f"{path} is truncated or corrupt (its header cannot be read: {e}); "
                         f"re-download or re-assemble the model file") from None
    tensors = _tensor_views(path, data, size, infos, data_start)
    config = _model_config(path, metadata, tensors)
    _check_tensors(path, config, tensors)
    return GGUFFile(path, metadata, tensors, config, data)


# --- header --------------------------------------------------------------------------------

class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError("string runs past the end of the file")
        s = bytes(self.buf[self.pos:end]).decode("utf-8", errors="surrogateescape")
        self.pos = end
        return s

    def value(self, vtype: int) -> Any:
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            etype = GGUFValueType(self.scalar("<I"))
            n = self.scalar("<Q")
            if etype == GGUFValueType.STRING:
                return [self.string() for _ in range(n)]
            if etype == GGUFValueType.ARRAY:
                return [self.value(GGUFValueType.ARRAY) for _ in range(n)]
            dtype = np.dtype(_ARRAY_DTYPES[etype])
            arr = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos)
            self.pos += n * dtype.itemsize
            return arr.tolist()
        return self.scalar(_SCALAR_FORMATS[vtype])


@dataclass
class _TensorInfo:
    name: str
    ne: tuple[int, ...]            # GGUF order: ne[0] is the contiguous (row) dimension
    ggml_type: int
    offset: int


def _parse_header(buf: memoryview) -> tuple[dict[str, Any], list[_TensorInfo], int]:
    cur = _Cursor(buf)
    cur.pos = 4
    version = cur.scalar("<I")
    if version & 0xFFFF == 0:
        raise ValueError("big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
    n_tensors = cur.scalar("<Q")
    n_kv = cur.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar("<I")
        ne = tuple(cur.scalar("<Q") for _ in range(n_dims))
        infos.append(_TensorInfo(name, ne, cur.scalar("<I"), cur.scalar("<Q")))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    return metadata, infos, data_start


def _tensor_views(path: Path, data: np.memmap, size: int, infos: list[_TensorInfo],
                  data_start: int) -> dict[str, TensorData]:
    tensors = {}
    for info in infos:
        try:
            qtype = GGMLQuantizationType(info.ggml_type)
        except ValueError:
            raise ModelError(f"{path}: tensor {info.name!r} has unknown GGML type {info.ggml_type}; "
                             f"this file needs a newer reader than tokentop's") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        shape = tuple(reversed(info.ne)) if info.ne else (1,)
        if shape[-1] % block:
            raise ModelError(f"{path} is corrupt: tensor {info.name!r} has rows of {shape[-1]} "
                             f"values, not a multiple of the {qtype.name} block size {block}")
        row_bytes = shape[-1] // block * type_size
        n_bytes = math.prod(shape[:-1]) * row_bytes
        start = data_start + info.offset
        if start + n_bytes > size:
            raise ModelError(f"{path} is truncated or corrupt: tensor {info.name!r} needs bytes up "
                             f"to {start + n_bytes:,} but the file has {size:,}; re-download or "
                             f"re-assemble the model file")
        raw = data[start:start + n_bytes].reshape(*shape[:-1], row_bytes)
        tensors[info.name] = TensorData(info.name, qtype, shape, raw)
    return tensors


# --- config --------------------------------------------------------------------------------

def _model_config(path: Path, md: dict[str, Any], tensors: dict[str, TensorData]) -> ModelConfig:
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelError(f"{path}: architecture {arch!r} is not supported; supported architectures "
                         f"are {', '.join(SUPPORTED_ARCHS)}")

    def req(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in md:
            raise ModelError(f"{path}: required metadata key {full!r} is missing; the file is "
                             f"incomplete or from an incompatible converter: re-convert it with a "
                             f"recent llama.cpp convert_hf_to_gguf.py")
        return md[full]

    def opt(key: str, default: Any) -> Any:
        return md.get(f"{arch}.{key}", default)

    def one_per_model(key: str, value: Any) -> int:
        if isinstance(value, list):    # some converters write one value per layer
            if len(set(value)) != 1:
                raise ModelError(f"{path}: {arch}.{key} differs between layers ({value}); "
                                 f"models with per-layer head counts are not supported")
            value = value[0]
        return int(value)

    gemma = arch == "gemma3"
    n_layers = int(req("block_count"))
    hidden = int(req("embedding_length"))
    n_heads = one_per_model("attention.head_count", req("attention.head_count"))
    n_kv_heads = one_per_model("attention.head_count_kv", opt("attention.head_count_kv", n_heads))
    head_dim = int(opt("attention.key_length", hidden // n_heads))
    rope_base = float(opt("rope.freq_base", 10000.0))

    scaling_type = opt("rope.scaling.type", None)
    rope_scaling = None
    if scaling_type not in (None, "none"):
        rope_scaling = {"type": scaling_type, "factor": float(opt("rope.scaling.factor", 1.0))}
        if f"{arch}.rope.scaling.original_context_length" in md:
            rope_scaling["original_context_length"] = int(md[f"{arch}.rope.scaling.original_context_length"])

    sliding_window = opt("attention.sliding_window", None)
    pattern: tuple[bool, ...] = ()
    if sliding_window is not None:
        raw_pattern = opt("attention.sliding_window_pattern", GEMMA3_SLIDING_PERIOD if gemma else None)
        if isinstance(raw_pattern, list):
            pattern = tuple(bool(p) for p in raw_pattern)
        elif raw_pattern is not None:
            pattern = tuple((i + 1) % int(raw_pattern) != 0 for i in range(n_layers))
        else:
            pattern = (True,) * n_layers
        if len(pattern) != n_layers:
            raise ModelError(f"{path}: {arch}.attention.sliding_window_pattern has {len(pattern)} "
                             f"entries for {n_layers} layers; the file is corrupt")

    embd = tensors.get("token_embd.weight")
    vocab_size = embd.shape[0] if embd is not None else len(md.get("tokenizer.ggml.tokens", ()))
    return ModelConfig(
        arch=arch,
        name=str(md.get("general.name", path.stem)),
        n_layers=n_layers,
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=int(req("feed_forward_length")),
        vocab_size=int(vocab_size),
        context_length=int(req("context_length")),
        rope_base=rope_base,
        rope_local_base=GEMMA3_LOCAL_ROPE_BASE if gemma else rope_base,
        rope_scaling=rope_scaling,
        rope_interleaved=arch == "llama",
        norm_eps=float(req("attention.layer_norm_rms_epsilon")),
        # architecture facts, so that a file missing such a tensor fails at load time
        qkv_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        qk_norm=gemma or "blk.0.attn_q_norm.weight" in tensors,
        activation="gelu_tanh" if gemma else "silu",
        embed_scale=math.sqrt(hidden) if gemma else 1.0,
        post_norms=gemma or "blk.0.post_attention_norm.weight" in tensors,
        tied_embeddings="output.weight" not in tensors,
        sliding_window=int(sliding_window) if sliding_window is not None else None,
        sliding_window_pattern=pattern,
        # Gemma 3 uses query_pre_attn_scalar**-0.5, which equals head_dim**-0.5 for every size but
        # 27B; GGUF stores it only as attention.scale when it differs (llama.cpp does the same).
        attn_scale=float(opt("attention.scale", head_dim ** -0.5)),
        final_logit_softcap=_optional_float(opt("final_logit_softcapping", None)),
        attn_logit_softcap=_optional_float(opt("attn_logit_softcapping", None)),
        metadata=md,
    )


def _optional_float(v: Any) -> float | None:
    return None if v is None else float(v)


def required_tensor_names(config: ModelConfig) -> list[str]:
    """Tensors the decoder reads, so a broken file fails at load time, not mid-forward."""
    names = ["token_embd.weight", "output_norm.weight"]
    if not config.tied_embeddings:
        names.append("output.weight")
    per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
    if config.qk_norm:
        per_layer += ["attn_q_norm", "attn_k_norm"]
    if config.post_norms:
        per_layer += ["post_attention_norm", "post_ffw_norm"]
    for i in range(config.n_layers):
        names += [f"blk.{i}.{p}.weight" for p in per_layer]
        if config.qkv_bias:
            names += [f"blk.{i}.attn_{p}.bias" for p in "qkv"]
    return names


def _check_tensors(path: Path, config: ModelConfig, tensors: dict[str, TensorData]) -> None:
    missing = [n for n in required_tensor_names(config) if n not in tensors]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ModelError(f"model file {path} has no tensor {missing[0]!r}{more} (needed by its "
                         f"{config.arch} architecture): the file is incomplete or was converted for "
                         f"another architecture; re-download it or pick another model")
    c = config
    expected = {
        "token_embd.weight": (c.vocab_size, c.hidden),
        "blk.0.attn_q.weight": (c.n_heads * c.head_dim, c.hidden),
        "blk.0.attn_k.weight": (c.n_kv_heads * c.head_dim, c.hidden),
        "blk.0.attn_v.weight": (c.n_kv_heads * c.head_dim, c.hidden),
        "blk.0.attn_output.weight": (c.hidden, c.n_heads * c.head_dim),
        "blk.0.ffn_gate.weight": (c.ffn_dim, c.hidden),
        "blk.0.ffn_down.weight": (c.hidden, c.ffn_dim),
    }
    for name, shape in expected.items():
        if c.n_layers == 0 and name.startswith("blk."):
            continue
        if tensors[name].shape != shape:
            raise ModelError(f"{path} is inconsistent: tensor {name!r} has shape "
                             f"{tensors[name].shape} but the metadata implies {shape}; the file is "
                             f"corrupt or was converted with a broken tool")
