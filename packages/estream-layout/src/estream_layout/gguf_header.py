"""A fast, strict reader of a GGUF file's header (metadata and tensor index, no tensor data).

`gguf.GGUFReader` builds a memory-mapped numpy view per metadata item, which takes tens of seconds
for a 50k-200k-token tokenizer; this parser reads the header bytes once with `struct` and
`numpy.frombuffer` (well under a second). It also reports where the KV section lies, so a
metadata-only copy of a model (`model.gguf` of a pack) is a verbatim byte copy.

Format (little-endian, version 2/3): magic "GGUF", u32 version, u64 n_tensors, u64 n_kv; n_kv
times (string key, u32 type, value); n_tensors times (string name, u32 n_dims, u64 ne[n_dims],
u32 ggml type, u64 offset); padding to `general.alignment` (default 32); tensor data.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, Final

import attrs
import numpy as np
from gguf import GGUFValueType

__all__ = ["GGUFHeader", "HeaderTensor", "read_header"]

_SCALAR: Final = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NP: Final = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}


@attrs.frozen
class HeaderTensor:
    name: str
    ne: tuple[int, ...]  # GGML order
    ggml_type: int
    offset: int  # absolute file offset of the data


@attrs.frozen(eq=False)
class GGUFHeader:
    version: int
    kv: dict[str, Any]  # key -> Python value (lists for arrays)
    kv_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]]  # key -> (type, array type)
    n_kv: int
    kv_span: tuple[int, int]  # byte range of the KV section
    tensors: tuple[HeaderTensor, ...]
    data_offset: int
    alignment: int


class _Cursor:
    def __init__(self, buf: bytes, fh: Any, strings: str) -> None:
        self.buf = buf
        self.pos = 0
        self.fh = fh
        self.strings = strings  # how string values decode bytes that are not UTF-8

    def need(self, n: int) -> None:
        while self.pos + n > len(self.buf):
            more = self.fh.read(max(n, 1 << 20))
            if not more:
                raise EOFError(f"header ends early at byte {len(self.buf)}")
            self.buf += more

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self, errors: str = "replace") -> str:
        n = self.unpack("<Q")
        if n > 1 << 32:
            raise ValueError(f"implausible string length {n}")
        self.need(n)
        s = self.buf[self.pos : self.pos + n].decode("utf-8", errors)
        self.pos += n
        return s

    def string_array(self, n: int) -> list[str]:
        """`n` strings: the bulk of a tokenizer's header (150k+ token texts), so one loop with
        the per-item work inlined."""
        out: list[str] = []
        append = out.append
        unpack = struct.Struct("<Q").unpack_from
        errors = self.strings
        for _ in range(n):
            if self.pos + 8 > len(self.buf):
                self.need(8)
            (ln,) = unpack(self.buf, self.pos)
            if ln > 1 << 32:
                raise ValueError(f"implausible string length {ln}")
            start = self.pos + 8
            if start + ln > len(self.buf):
                self.need(8 + ln)
            append(self.buf[start : start + ln].decode("utf-8", errors))
            self.pos = start + ln
        return out

    def value(self, vtype: GGUFValueType) -> tuple[Any, GGUFValueType | None]:
        if vtype == GGUFValueType.STRING:
            return self.string(self.strings), None
        if vtype in _SCALAR:
            return self.unpack(_SCALAR[vtype]), None
        if vtype == GGUFValueType.ARRAY:
            sub = GGUFValueType(self.unpack("<I"))
            n = self.unpack("<Q")
            if sub in _NP:
                dt = np.dtype(_NP[sub])
                self.need(n * dt.itemsize)
                arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos)
                self.pos += n * dt.itemsize
                return arr.tolist(), sub
            if sub == GGUFValueType.STRING:
                return self.string_array(n), sub
            return [self.value(sub)[0] for _ in range(n)], sub
        raise ValueError(f"unknown GGUF value type {vtype}")


def read_header(path: str | Path, *, strings: str = "replace") -> GGUFHeader:
    """Parse magic, version, metadata and tensor index. Raises EOFError/ValueError on a short
    or malformed header (callers turn these into TruncatedGGUFError), OSError from open/read.

    `strings` is the decoding error handler of string values (keys always use "replace"):
    a tokenizer that must keep a token text's bytes that are not UTF-8 passes
    "surrogateescape"."""
    with open(path, "rb") as fh:
        cur = _Cursor(fh.read(1 << 20), fh, strings)
        if cur.unpack("<I") != 0x46554747:  # b"GGUF" little-endian
            raise ValueError("GGUF magic invalid")
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        n_tensors = cur.unpack("<Q")
        n_kv = cur.unpack("<Q")
        kv: dict[str, Any] = {}
        kv_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
        kv_start = cur.pos
        for _ in range(n_kv):
            key = cur.string()
            vtype = GGUFValueType(cur.unpack("<I"))
            val, sub = cur.value(vtype)
            if key in kv:
                raise ValueError(f"metadata key {key!r} appears twice")
            kv[key] = val
            kv_types[key] = (vtype, sub)
        kv_end = cur.pos
        raw_tensors = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("<I")
            if n_dims > 8:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
            ne = tuple(cur.unpack("<Q") for _ in range(n_dims))
            ggml_type = cur.unpack("<I")
            offset = cur.unpack("<Q")
            raw_tensors.append((name, ne, ggml_type, offset))
        alignment = kv.get("general.alignment", 32)
        # llama.cpp asserts a power of two; 0, a string or a list must not divide by zero later
        if isinstance(alignment, bool) or not isinstance(alignment, int):
            raise ValueError(f"general.alignment {alignment!r} is not an integer")
        if not 1 <= alignment <= 1 << 16 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment} is not a power of two up to 65536")
        data_offset = -(-cur.pos // alignment) * alignment
    tensors = tuple(
        HeaderTensor(name, ne, ggml_type, data_offset + offset)
        for name, ne, ggml_type, offset in raw_tensors
    )
    return GGUFHeader(
        version=version,
        kv=kv,
        kv_types=kv_types,
        n_kv=n_kv,
        kv_span=(kv_start, kv_end),
        tensors=tensors,
        data_offset=data_offset,
        alignment=alignment,
    )
