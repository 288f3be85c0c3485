"""Read the tokenizer metadata (``tokenizer.ggml.*``) from a GGUF header.

A small direct reader of the GGUF key/value section rather than :class:`gguf.GGUFReader`: the
latter builds one numpy view per array element, which takes 5-10 s for a 150k-token
vocabulary; reading the same keys directly takes a fraction of a second. Tests cross-check the
two on the shipped vocabularies. Only the header is touched (through ``mmap``), so this is
cheap on multi-GB model files too.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

from ._errors import GGUFReadError, MissingTokenizerError

__all__ = ["read_tokenizer_metadata", "resolve_gguf_path"]

_PACKED_GGUF = "model.gguf"
_MAGIC = b"GGUF"

# GGUF value types -> (struct format, numpy dtype) for the fixed-size ones.
_FIXED = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING = 8
_ARRAY = 9


def resolve_gguf_path(path: str | Path) -> Path:
    """The GGUF file for ``path``: the file itself, or ``model.gguf`` of a packed model dir."""
    p = Path(path)
    if p.is_dir():
        inner = p / _PACKED_GGUF
        if not inner.is_file():
            raise GGUFReadError(
                f"{p} is a directory without {_PACKED_GGUF}: give a GGUF file or a packed "
                "model directory (NAME.estream)"
            )
        return inner
    if not p.is_file():
        raise GGUFReadError(f"{p} does not exist (expected a GGUF file or a packed model dir)")
    return p


class _Cursor:
    """Little-endian reads from a buffer, with bounds checks that raise GGUFReadError."""

    def __init__(self, buf: Any, path: Path) -> None:
        self.buf = buf
        self.off = 0
        self.path = path

    def _need(self, n: int) -> None:
        if n < 0 or self.off + n > len(self.buf):
            raise GGUFReadError(f"{self.path}: truncated or corrupt GGUF header at byte {self.off}")

    def fixed(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from(fmt, self.buf, self.off)
        self.off += size
        return value

    def raw_string(self) -> bytes:
        n = self.fixed("<Q")
        self._need(n)
        s = bytes(self.buf[self.off : self.off + n])
        self.off += n
        return s

    def skip_value(self, vtype: int) -> None:
        self.value(vtype, keep=False)

    def value(self, vtype: int, *, keep: bool = True) -> Any:
        if vtype in _FIXED:
            return self.fixed(_FIXED[vtype][0])
        if vtype == _STRING:
            return self.raw_string().decode("utf-8", "replace")
        if vtype == _ARRAY:
            etype = self.fixed("<I")
            n = self.fixed("<Q")
            if etype in _FIXED:
                dtype = np.dtype(_FIXED[etype][1]).newbyteorder("<")
                size = n * dtype.itemsize
                self._need(size)
                arr = (
                    np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.off) if keep else None
                )
                self.off += size
                return None if arr is None else arr.copy()
            if etype == _STRING:
                out = []
                buf, off = self.buf, self.off
                unpack = struct.Struct("<Q").unpack_from
                end = len(buf)
                for _ in range(n):
                    if off + 8 > end:
                        self.off = off
                        self._need(8)
                    (ln,) = unpack(buf, off)
                    off += 8
                    if off + ln > end:
                        self.off = off
                        self._need(ln)
                    if keep:
                        out.append(str(buf[off : off + ln], "utf-8", "surrogateescape"))
                    off += ln
                self.off = off
                return out if keep else None
            items = [self.value(etype, keep=keep) for _ in range(n)]
            return items if keep else None
        raise GGUFReadError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.off}")


def _wanted(key: str) -> bool:
    return key.startswith("tokenizer.ggml.") or key == "general.name"


def read_tokenizer_metadata(path: str | Path) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` keys of a GGUF (and ``general.name``), decoded.

    String arrays become ``list[str]`` (token texts keep undecodable bytes as surrogate
    escapes), numeric arrays ``numpy`` arrays, scalars Python values.
    """
    gguf_path = resolve_gguf_path(path)
    with gguf_path.open("rb") as f:
        if f.read(4) != _MAGIC:
            raise GGUFReadError(f"{gguf_path} is not a GGUF file (it does not start with b'GGUF')")
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (ValueError, OSError) as exc:
            raise GGUFReadError(f"cannot map {gguf_path}: {exc}") from exc
    try:
        cur = _Cursor(memoryview(mm), gguf_path)
        cur.off = 4
        version = cur.fixed("<I")
        if version not in (2, 3):
            raise GGUFReadError(f"{gguf_path}: GGUF version {version} is not supported (2 or 3)")
        cur.fixed("<Q")  # tensor count
        n_kv = cur.fixed("<Q")
        out: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.raw_string().decode("utf-8", "replace")
            vtype = cur.fixed("<I")
            if _wanted(key):
                out[key] = cur.value(vtype)
            else:
                cur.skip_value(vtype)
        del cur
    finally:
        with contextlib.suppress(BufferError):  # a stray view still alive: GC closes it
            mm.close()
    if "tokenizer.ggml.model" not in out:
        raise MissingTokenizerError(
            f"{gguf_path} has no tokenizer metadata (no 'tokenizer.ggml.model' key); "
            "was it converted with its vocabulary?"
        )
    tokens = out.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise MissingTokenizerError(f"{gguf_path} has no 'tokenizer.ggml.tokens' string array")
    return out
