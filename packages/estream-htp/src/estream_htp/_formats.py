"""Tile-major weight formats (docs/contracts.md §1), written independently of estream-layout.

GGML block layouts used as the "source" form:
* Q4_0 block (18 B): fp16 scale ``d``, then 16 bytes ``qs``; element ``j`` (0..15) is the low
  nibble of ``qs[j]`` and element ``j+16`` its high nibble; value = ``d * (nibble - 8)``.
* Q8_0 block (34 B): fp16 scale ``d``, then 32 int8; value = ``d * q``.

Tile formats: ``W[N][K]`` in 32x32 tiles, output-tile major; a tile is 32 fp16 scales (row order)
then groups of 128 B holding, for rows 0..31 in order, 4 consecutive ``qs`` bytes of that row.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = [
    "Q4_0_TILE_BYTES",
    "Q8_0_TILE_BYTES",
    "TILE_FORMATS",
    "FormatError",
    "dequantize_q4_0",
    "dequantize_q8_0",
    "dequantize_tiles",
    "matrix_nbytes",
    "pack_q4_0_t32r4",
    "pack_q8_0_t32r4",
    "quantize_q4_0",
    "quantize_q8_0",
    "unpack_q4_0_t32r4",
    "unpack_q8_0_t32r4",
]

Q4_0_TILE_BYTES = 576
Q8_0_TILE_BYTES = 1088
TILE_FORMATS = {"q4_0-t32r4": Q4_0_TILE_BYTES, "q8_0-t32r4": Q8_0_TILE_BYTES}


class FormatError(ValueError):
    """A matrix or block array does not fit the tile format."""


def matrix_nbytes(fmt: str, n: int, k: int) -> int:
    """Bytes of ``W[n][k]`` in a tile format: ``ceil(n/32) * (k/32) * tile_bytes``."""
    if fmt not in TILE_FORMATS:
        raise FormatError(f"unknown tile format {fmt!r}; expected one of {sorted(TILE_FORMATS)}")
    if k <= 0 or k % 32 or n <= 0:
        raise FormatError(f"need n > 0 and k a positive multiple of 32, got n={n}, k={k}")
    return -(-n // 32) * (k // 32) * TILE_FORMATS[fmt]


def _check_matrix(w: npt.ArrayLike) -> npt.NDArray[np.float32]:
    a = np.asarray(w, dtype=np.float32)
    if a.ndim != 2 or a.shape[1] % 32 or a.shape[0] == 0 or a.shape[1] == 0:
        raise FormatError(f"expected a float matrix [N, K] with K % 32 == 0, got shape {a.shape}")
    return a


def quantize_q4_0(w: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """GGML-style Q4_0 quantization of ``w[N, K]`` into blocks ``uint8[N, K/32, 18]``."""
    a = _check_matrix(w)
    n, k = a.shape
    b = a.reshape(n, k // 32, 32)
    idx = np.argmax(np.abs(b), axis=2)
    mx = np.take_along_axis(b, idx[..., None], axis=2)[..., 0]
    d = mx / np.float32(-8.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    q = np.clip(np.trunc(b * inv[..., None] + np.float32(8.5)), 0, 15).astype(np.uint8)
    out = np.empty((n, k // 32, 18), dtype=np.uint8)
    out[..., :2] = d.astype(np.float16)[..., None].view(np.uint8)
    out[..., 2:] = q[..., :16] | (q[..., 16:] << 4)
    return out


def quantize_q8_0(w: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """GGML-style Q8_0 quantization of ``w[N, K]`` into blocks ``uint8[N, K/32, 34]``."""
    a = _check_matrix(w)
    n, k = a.shape
    b = a.reshape(n, k // 32, 32)
    amax = np.max(np.abs(b), axis=2)
    d = amax / np.float32(127.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    q = np.rint(b * inv[..., None]).astype(np.int8)
    out = np.empty((n, k // 32, 34), dtype=np.uint8)
    out[..., :2] = d.astype(np.float16)[..., None].view(np.uint8)
    out[..., 2:] = q.view(np.uint8)
    return out


def _blocks(blocks: npt.ArrayLike, size: int) -> npt.NDArray[np.uint8]:
    b = np.asarray(blocks)
    if b.dtype != np.uint8:
        raise FormatError(f"blocks must be uint8, got {b.dtype}")
    if b.ndim == 2 and b.shape[1] % size == 0:
        b = b.reshape(b.shape[0], b.shape[1] // size, size)
    if b.ndim != 3 or b.shape[2] != size or b.shape[0] == 0 or b.shape[1] == 0:
        raise FormatError(
            f"expected blocks uint8[N, K/32, {size}] (or [N, K/32*{size}]), got {b.shape}"
        )
    return b


def dequantize_q4_0(blocks: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """Blocks ``uint8[N, K/32, 18]`` → ``float32[N, K]``."""
    b = _blocks(blocks, 18)
    d = np.ascontiguousarray(b[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    qs = b[..., 2:]
    q = np.concatenate([qs & 15, qs >> 4], axis=2).astype(np.float32) - 8.0
    return (q * d[..., None]).reshape(b.shape[0], -1)


def dequantize_q8_0(blocks: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """Blocks ``uint8[N, K/32, 34]`` → ``float32[N, K]``."""
    b = _blocks(blocks, 34)
    d = np.ascontiguousarray(b[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    q = np.ascontiguousarray(b[..., 2:]).view(np.int8).astype(np.float32)
    return (q * d[..., None]).reshape(b.shape[0], -1)


def _pack(b: npt.NDArray[np.uint8], qbytes: int, pad_q: int) -> npt.NDArray[np.uint8]:
    n, kb, _ = b.shape
    npad = -(-n // 32) * 32
    if npad != n:
        fill = np.zeros((npad - n, kb, 2 + qbytes), dtype=np.uint8)
        fill[..., 2:] = pad_q
        b = np.concatenate([b, fill], axis=0)
    t = b.reshape(npad // 32, 32, kb, 2 + qbytes).transpose(0, 2, 1, 3)  # [ti, j, r, bytes]
    scales = t[..., :2].reshape(npad // 32, kb, 64)
    groups = t[..., 2:].reshape(npad // 32, kb, 32, qbytes // 4, 4).transpose(0, 1, 3, 2, 4)
    groups = groups.reshape(npad // 32, kb, qbytes * 32)
    return np.ascontiguousarray(np.concatenate([scales, groups], axis=2)).reshape(-1)


def _unpack(buf: npt.ArrayLike, n: int, k: int, qbytes: int, fmt: str) -> npt.NDArray[np.uint8]:
    nbytes = matrix_nbytes(fmt, n, k)
    a = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1)
    if a.dtype != np.uint8 or a.size < nbytes:
        raise FormatError(f"{fmt} W[{n}][{k}] needs {nbytes} uint8 bytes, got {a.size} {a.dtype}")
    nt, kb = -(-n // 32), k // 32
    t = a[:nbytes].reshape(nt, kb, 64 + 32 * qbytes)
    scales = t[..., :64].reshape(nt, kb, 32, 2)
    groups = t[..., 64:].reshape(nt, kb, qbytes // 4, 32, 4).transpose(0, 1, 3, 2, 4)
    groups = groups.reshape(nt, kb, 32, qbytes)
    blocks = np.concatenate([scales, groups], axis=3).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(blocks.reshape(nt * 32, kb, 2 + qbytes)[:n])


def pack_q4_0_t32r4(w: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """Pack into ``q4_0-t32r4`` (flat uint8). ``w`` is either a float matrix ``[N, K]``
    (quantized to Q4_0 first) or GGML Q4_0 blocks ``uint8[N, K/32, 18]`` / ``[N, K/32*18]``
    (repacked losslessly)."""
    a = np.asarray(w)
    b = _blocks(a, 18) if a.dtype == np.uint8 else quantize_q4_0(a)
    return _pack(b, 16, 0x88)


def pack_q8_0_t32r4(w: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """Pack into ``q8_0-t32r4``: float ``[N, K]`` or Q8_0 blocks ``uint8[N, K/32, 34]``."""
    a = np.asarray(w)
    b = _blocks(a, 34) if a.dtype == np.uint8 else quantize_q8_0(a)
    return _pack(b, 32, 0)


def unpack_q4_0_t32r4(buf: npt.ArrayLike, n: int, k: int) -> npt.NDArray[np.uint8]:
    """Inverse of :func:`pack_q4_0_t32r4`: Q4_0 blocks ``uint8[n, k/32, 18]``."""
    return _unpack(buf, n, k, 16, "q4_0-t32r4")


def unpack_q8_0_t32r4(buf: npt.ArrayLike, n: int, k: int) -> npt.NDArray[np.uint8]:
    """Inverse of :func:`pack_q8_0_t32r4`: Q8_0 blocks ``uint8[n, k/32, 34]``."""
    return _unpack(buf, n, k, 32, "q8_0-t32r4")


def dequantize_tiles(buf: npt.ArrayLike, fmt: str, n: int, k: int) -> npt.NDArray[np.float32]:
    """``float32[n, k]`` values of a tile-format matrix (padding rows dropped)."""
    if fmt == "q4_0-t32r4":
        return dequantize_q4_0(unpack_q4_0_t32r4(buf, n, k))
    if fmt == "q8_0-t32r4":
        return dequantize_q8_0(unpack_q8_0_t32r4(buf, n, k))
    raise FormatError(f"unknown tile format {fmt!r}; expected one of {sorted(TILE_FORMATS)}")
