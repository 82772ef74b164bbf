"""The header of a GGUF file: metadata key/values and tensor infos, read straight from its bytes.

Parsed here rather than with gguf.GGUFReader: the reader builds a numpy view per array
element and took 17-23 s to open the real models (151,936 / 262,144 vocabulary strings);
this parser takes well under a second. Every count in the header (keys, tensors, dimensions,
string and array lengths) is checked against the bytes left in the file, and against a limit
far above any real model, before anything is allocated for it: a corrupt count is a one-line
error, never a loop of billions or a list of gigabytes.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from gguf import GGUFValueType

from engine.errors import ModelError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Limits on what one header may declare. The real models hold 291-340 tensors, ~40 keys and
# 786,432 array entries in all (Gemma 3's 262,144 tokens with their scores and types).
MAX_TENSORS = 1 << 16
MAX_KEYS = 1 << 16
MAX_ARRAY_ENTRIES = 1 << 23        # over all arrays of the file together
MAX_STRING_BYTES = 1 << 26         # one string; an embedded tokenizer.json is a few MB
MAX_KEY_BYTES = (1 << 16) - 1      # the GGUF spec's limit on a key
MAX_TENSOR_NAME_BYTES = 63         # ggml's GGML_MAX_NAME (64) with its terminating NUL
MAX_DIMS = 4                       # ggml's GGML_MAX_DIMS
_MIN_KV_BYTES = 8 + 4 + 1          # key length, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8   # name length, n_dims, type, offset

_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_SCALARS = {
    GGUFValueType.UINT8: struct.Struct("<B"), GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"), GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: _U32, GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.UINT64: _U64, GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT32: struct.Struct("<f"), GGUFValueType.FLOAT64: struct.Struct("<d"),
    GGUFValueType.BOOL: struct.Struct("<?"),
}
_ARRAY_DTYPES = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.FLOAT64: "<f8",
    GGUFValueType.BOOL: "?",
}


@dataclass
class TensorInfo:
    name: str
    ne: tuple[int, ...]            # GGUF order: ne[0] is the contiguous (row) dimension
    ggml_type: int
    offset: int                    # from the start of the data section


@dataclass
class Header:
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    alignment: int
    data_start: int                # first byte of the data section (aligned)


def shown(value: Any, limit: int = 60) -> str:
    """A value from the file, fit for a one-line message: repr, shortened."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def corrupt(path: Path, what: str, *, truncated: bool = False) -> ModelError:
    state = "truncated or corrupt" if truncated else "corrupt"
    return ModelError(f"{path} is {state}: {what}; re-download or re-assemble the model file")


class _Reader:
    """A position in the header; every read checks that the bytes exist."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf = buf
        self.size = len(buf)
        self.path = path
        self.pos = 0
        self.array_entries_left = MAX_ARRAY_ENTRIES

    def fail(self, what: str, *, truncated: bool = False) -> NoReturn:
        raise corrupt(self.path, what, truncated=truncated)

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            self.fail(f"{what} needs {n:,} bytes at offset {self.pos:,} but the file ends at "
                      f"{self.size:,}", truncated=True)

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str, limit: int) -> str:
        n = self.u64(f"the length of {what}")
        if n > limit:
            self.fail(f"{what} claims {n:,} bytes (at most {limit:,} are accepted)")
        self.need(n, what)
        s = str(self.buf[self.pos:self.pos + n], "utf-8", "surrogateescape")
        self.pos += n
        return s

    def value(self, vtype: int, key: str) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string(f"the value of {shown(key)}", MAX_STRING_BYTES)
        if vtype == GGUFValueType.ARRAY:
            return self.array(key)
        fmt = _SCALARS.get(vtype)
        if fmt is None:
            self.fail(f"metadata {shown(key)} has unknown value type {vtype}")
        self.need(fmt.size, f"the value of {shown(key)}")
        (v,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return v

    def array(self, key: str) -> list:
        etype = self.u32(f"the element type of {shown(key)}")
        n = self.u64(f"the length of {shown(key)}")
        if etype == GGUFValueType.STRING:
            item_bytes = 8
        elif etype in _ARRAY_DTYPES:
            item_bytes = np.dtype(_ARRAY_DTYPES[etype]).itemsize
        elif etype == GGUFValueType.ARRAY:
            self.fail(f"metadata {shown(key)} is an array of arrays, which GGUF readers (llama.cpp's "
                      f"and this one) do not accept")
        else:
            self.fail(f"metadata {shown(key)} is an array of unknown value type {etype}")
        if n * item_bytes > self.size - self.pos:
            self.fail(f"metadata {shown(key)} claims {n:,} entries, more than the "
                      f"{self.size - self.pos:,} bytes left in the file can hold", truncated=True)
        if n > self.array_entries_left:
            self.fail(f"metadata {shown(key)} claims {n:,} entries, beyond the "
                      f"{MAX_ARRAY_ENTRIES:,} array entries accepted in one file")
        self.array_entries_left -= n
        if etype == GGUFValueType.STRING:
            return self.strings(n, key)
        arr = np.frombuffer(self.buf, dtype=_ARRAY_DTYPES[etype], count=n, offset=self.pos)
        self.pos += n * item_bytes
        return arr.tolist()

    def strings(self, n: int, key: str) -> list[str]:
        # the vocabulary's loop: 150-260 thousand strings, so the checks are inline
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        out = []
        append = out.append
        for i in range(n):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"the length of entry {i} of {shown(key)}")
            (k,) = unpack(buf, pos)
            pos += 8
            if k > MAX_STRING_BYTES:
                self.fail(f"entry {i} of {shown(key)} claims {k:,} bytes (at most "
                          f"{MAX_STRING_BYTES:,} are accepted)")
            if k > size - pos:
                self.pos = pos
                self.need(k, f"entry {i} of {shown(key)}")
            append(str(buf[pos:pos + k], "utf-8", "surrogateescape"))
            pos += k
        self.pos = pos
        return out


def read_header(buf: memoryview, path: Path) -> Header:
    """Parse the header of the file mapped as `buf` (which starts with GGUF_MAGIC)."""
    r = _Reader(buf, path)
    r.pos = len(GGUF_MAGIC)
    version = r.u32("the version")
    if version & 0xFFFF == 0:
        r.fail("it is a big-endian GGUF file, which tokentop does not read")
    if version not in (2, 3):
        r.fail(f"GGUF version {version} is not supported (2 and 3 are)")
    n_tensors = r.u64("the tensor count")
    n_kv = r.u64("the metadata key count")
    if n_tensors > MAX_TENSORS or n_kv > MAX_KEYS:
        r.fail(f"it declares {n_tensors:,} tensors and {n_kv:,} metadata keys (at most "
               f"{MAX_TENSORS:,} and {MAX_KEYS:,} are accepted)")
    if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > r.size - r.pos:
        r.fail(f"it declares {n_tensors:,} tensors and {n_kv:,} metadata keys, more than its "
               f"{r.size:,} bytes can describe", truncated=True)

    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = r.string(f"the name of metadata key #{i}", MAX_KEY_BYTES)
        if key in metadata:
            r.fail(f"metadata key {shown(key)} appears twice")
        metadata[key] = r.value(r.u32(f"the value type of {shown(key)}"), key)

    infos: list[TensorInfo] = []
    seen: set[str] = set()
    for i in range(n_tensors):
        name = r.string(f"the name of tensor #{i}", MAX_TENSOR_NAME_BYTES)
        if name in seen:
            r.fail(f"tensor {shown(name)} appears twice in the tensor table")
        seen.add(name)
        n_dims = r.u32(f"the dimension count of tensor {shown(name)}")
        if n_dims > MAX_DIMS:
            r.fail(f"tensor {shown(name)} claims {n_dims:,} dimensions (at most {MAX_DIMS})")
        ne = tuple(r.u64(f"dimension {d} of tensor {shown(name)}") for d in range(n_dims))
        ggml_type = r.u32(f"the type of tensor {shown(name)}")
        infos.append(TensorInfo(name, ne, ggml_type, r.u64(f"the data offset of tensor {shown(name)}")))

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        r.fail(f"general.alignment {shown(alignment)} is not a power of two")
    data_start = -(-r.pos // alignment) * alignment
    return Header(version, metadata, infos, alignment, data_start)
