"""Tile-major weight formats (docs/contracts.md §1), written independently of estream-layout.

GGML block layouts used as the "source" form:
* Q4_0 block (18 B): fp16 scale ``d``, then 16 bytes ``qs``; element ``j`` (0..15) is the low
  nibble of ``qs[j]`` and element ``j+16`` its high nibble; value = ``d * (nibble - 8)``.
* Q8_0 block (34 B): fp16 scale ``d``, then 32 int8; value = ``d * q``.
* MXFP4 block (17 B): one E8M0 exponent byte ``e``, then 16 bytes of 4-bit FP4 (E2M1) codes in
  Q4_0's nibble order; value = ``kv[code] * 2^(e - 128)`` with ``kv`` the doubled E2M1 values.

Tile formats: ``W[N][K]`` in 32x32 tiles, output-tile major; a tile is 32 fp16 scales (row order)
then groups of 128 B holding, for rows 0..31 in order, 4 consecutive ``qs`` bytes of that row.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = [
    "FLOAT_TILE_FORMATS",
    "MXFP4_TILE_BYTES",
    "Q4_0_TILE_BYTES",
    "Q8_0_TILE_BYTES",
    "TILE_FORMATS",
    "FormatError",
    "dequantize_f16_t32r4",
    "dequantize_iq4_nl",
    "dequantize_iq4_xs",
    "dequantize_mxfp4",
    "dequantize_q4_0",
    "dequantize_q4_1_q5",
    "dequantize_q4_k",
    "dequantize_q5_k",
    "dequantize_q6_k",
    "dequantize_q8_0",
    "dequantize_tiles",
    "matrix_nbytes",
    "pack_f16_t32r4",
    "pack_iq4_nl_t32r4",
    "pack_iq4_xs_t32r4",
    "pack_mxfp4_t32r4",
    "pack_q4_0_t32r4",
    "pack_q4_1_q5_t32r4",
    "pack_q4_k_t32r4",
    "pack_q5_k_t32r4",
    "pack_q6_k_t32r4",
    "pack_q8_0_t32r4",
    "quantize_mxfp4",
    "quantize_q4_0",
    "quantize_q8_0",
    "unpack_iq4_nl_t32r4",
    "unpack_iq4_xs_t32r4",
    "unpack_mxfp4_t32r4",
    "unpack_q4_0_t32r4",
    "unpack_q4_1_q5_t32r4",
    "unpack_q4_k_t32r4",
    "unpack_q5_k_t32r4",
    "unpack_q6_k_t32r4",
    "unpack_q8_0_t32r4",
]

Q4_0_TILE_BYTES = 576
Q8_0_TILE_BYTES = 1088
Q4_K_TILE_BYTES = 704
Q5_K_TILE_BYTES = 832
Q6_K_TILE_BYTES = 1152
MXFP4_TILE_BYTES = 544
TILE_FORMATS = {
    "q4_0-t32r4": Q4_0_TILE_BYTES,
    "q8_0-t32r4": Q8_0_TILE_BYTES,
    "q4_k-t32r4": Q4_K_TILE_BYTES,
    "q5_k-t32r4": Q5_K_TILE_BYTES,
    "q6_k-t32r4": Q6_K_TILE_BYTES,
    "mxfp4-t32r4": MXFP4_TILE_BYTES,
    "iq4_nl-t32r4": Q4_0_TILE_BYTES,
    "q4_1-t32r4": 640,
    "q5_0-t32r4": 704,
    "q5_1-t32r4": 768,
    "iq4_xs-t32r4": 608,
    "f16-t32r4": 2048,
    "bf16-t32r4": 2048,
}
# Tile formats of 16-bit float values (dense matrices only): multiplied in fp32 under either
# activation format, never with int8 activation rows.
FLOAT_TILE_FORMATS = ("f16-t32r4", "bf16-t32r4")
QK_K = 256  # values of a K-quant super-block
Q4_K_BLOCK_BYTES = 144  # fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
Q5_K_BLOCK_BYTES = 176  # Q4_K's d, dmin, scales, then qh[32] (fifth bits), then qs[128]
Q6_K_BLOCK_BYTES = 210  # 128 bytes low nibbles, 64 bytes high bits, 16 int8 scales, fp16 d
IQ4_XS_BLOCK_BYTES = 136  # fp16 d, uint16 scales_h, 4 bytes scales_l, 128 bytes of codes


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


# ---------------------------------------------------------------- K-quant tiles
# A K-quant super-block (256 values) is cut into its eight 32-value sub-blocks; each becomes one
# row of a 32x32 tile, with the super-block's scales repeated in each (docs/format.md §1):
#   q4_k-t32r4: fp16 d [32], fp16 dmin [32], uint8 sc [32], uint8 m [32] (6-bit values), then the
#               32 nibbles of each row in Q4_0 order (byte i: value i low, value i+16 high);
#   q6_k-t32r4: fp16 d [32], int8 scale pairs [32][2] (values 0..15, 16..31), then the int8
#               values q - 32 (-32..31).
def _kblocks(blocks: npt.ArrayLike, size: int) -> npt.NDArray[np.uint8]:
    b = np.asarray(blocks)
    if b.dtype != np.uint8:
        raise FormatError(f"blocks must be uint8, got {b.dtype}")
    if b.ndim == 2 and b.shape[1] % size == 0:
        b = b.reshape(b.shape[0], b.shape[1] // size, size)
    if b.ndim != 3 or b.shape[2] != size or b.shape[0] == 0 or b.shape[1] == 0:
        raise FormatError(
            f"expected blocks uint8[N, K/256, {size}] (or [N, K/256*{size}]), got {b.shape}"
        )
    return b


def _q4_k_fields(b: npt.NDArray[np.uint8]) -> list[npt.NDArray[np.uint8]]:
    """Q4_K blocks [N, S, 144] -> per sub-block fields [N, 8S, *]: d, dmin, sc, m, nibbles."""
    n, sb, _ = b.shape
    d = np.repeat(b[..., 0:2], 8, axis=1)
    dmin = np.repeat(b[..., 2:4], 8, axis=1)
    sc6 = b[..., 4:16].reshape(n, sb, 3, 4)
    lo, mi, hi = sc6[:, :, 0], sc6[:, :, 1], sc6[:, :, 2]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=2)
    mn = np.concatenate([mi & 0x3F, (hi >> 4) | ((mi >> 2) & 0x30)], axis=2)
    qs = b[..., 16:].reshape(n, sb, 4, 1, 32)
    v = ((qs >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 15).reshape(n, sb * 8, 32)
    nib = v[..., :16] | (v[..., 16:] << 4)
    return [d, dmin, sc.reshape(n, sb * 8, 1), mn.reshape(n, sb * 8, 1), nib]


def _q4_k_blocks(f: list[npt.NDArray[np.uint8]]) -> npt.NDArray[np.uint8]:
    d, dmin, sc, mn, nib = f
    n, kb, _ = nib.shape
    sb = kb // 8
    v = np.concatenate([nib & 15, nib >> 4], axis=2).reshape(n, sb, 4, 2, 32)
    qs = (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).reshape(n, sb, 128)
    sc, mn = sc.reshape(n, sb, 8), mn.reshape(n, sb, 8)
    lo = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    mi = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    hi = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    return np.concatenate(
        [d.reshape(n, sb, 8, 2)[:, :, 0], dmin.reshape(n, sb, 8, 2)[:, :, 0], lo, mi, hi, qs],
        axis=2,
    ).astype(np.uint8)


# q5_k-t32r4 (832 B): q4_k-t32r4's header and nibbles (the low 4 bits of each value), then one
# more 128-byte group: row r's 32 fifth bits as a little-endian uint32 at 704 + 4r (bit c =
# column c). Q5_K block (176 B): d, dmin, scales[12] as Q4_K, qh[32] (bit j of qh[l]: the fifth
# bit of value l of sub-block j), qs[128] as Q4_K's.
def _q5_k_fields(b: npt.NDArray[np.uint8]) -> list[npt.NDArray[np.uint8]]:
    """Q5_K blocks [N, S, 176] -> per sub-block fields [N, 8S, *]: d, dmin, sc, m, then the 16
    nibble bytes and the 4 bytes of fifth bits."""
    n, sb, _ = b.shape
    f = _q4_k_fields(np.concatenate([b[..., :16], b[..., 48:]], axis=2))
    qh = b[..., 16:48].reshape(n, sb, 1, 32)
    bits = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1  # [n, sb, j, l]
    words = (bits.reshape(n, sb * 8, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(
        axis=2
    )
    f[-1] = np.concatenate([f[-1], words.astype("<u4").view(np.uint8).reshape(n, sb * 8, 4)], 2)
    return f


def _q5_k_blocks(f: list[npt.NDArray[np.uint8]]) -> npt.NDArray[np.uint8]:
    d, dmin, sc, mn, q = f
    n, kb, _ = q.shape
    sb = kb // 8
    b4 = _q4_k_blocks([d, dmin, sc, mn, q[..., :16]])
    words = np.ascontiguousarray(q[..., 16:20]).view("<u4")[..., 0].astype(np.uint64)
    bits = ((words[..., None] >> np.arange(32, dtype=np.uint64)) & 1).astype(np.uint8)
    qh = (bits.reshape(n, sb, 8, 32) << np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)).sum(
        axis=2, dtype=np.uint8
    )
    return np.concatenate([b4[..., :16], qh, b4[..., 16:]], axis=2)


def _q6_k_fields(b: npt.NDArray[np.uint8]) -> list[npt.NDArray[np.uint8]]:
    """Q6_K blocks [N, S, 210] -> per sub-block fields [N, 8S, *]: d, scale pair, int8 values."""
    n, sb, _ = b.shape
    ql = b[..., :128].reshape(n, sb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    ql = (ql & 15).reshape(n, sb, 8, 32)  # sub-block 4h + 2*nibble + half, value l
    qh = b[..., 128:192].reshape(n, sb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
        1, 1, 1, 4, 1
    )
    qh = (qh & 3).reshape(n, sb, 8, 32)
    q = ((ql | (qh << 4)).astype(np.int16) - 32).astype(np.int8).view(np.uint8)
    d = np.repeat(b[..., 208:210], 8, axis=1)
    return [d, b[..., 192:208].reshape(n, sb * 8, 2), q.reshape(n, sb * 8, 32)]


def _q6_k_blocks(f: list[npt.NDArray[np.uint8]]) -> npt.NDArray[np.uint8]:
    d, sc, q = f
    n, kb, _ = q.shape
    sb = kb // 8
    u = (q.view(np.int8).astype(np.int16) + 32).astype(np.uint8).reshape(n, sb, 2, 4, 32)
    low = u & 15
    ql = (low[:, :, :, 0:2] | (low[:, :, :, 2:4] << 4)).reshape(n, sb, 128)
    hb = u >> 4
    qh = hb[:, :, :, 0] | (hb[:, :, :, 1] << 2) | (hb[:, :, :, 2] << 4) | (hb[:, :, :, 3] << 6)
    return np.concatenate(
        [ql, qh.reshape(n, sb, 64), sc.reshape(n, sb, 16), d.reshape(n, sb, 8, 2)[:, :, 0]],
        axis=2,
    ).astype(np.uint8)


def _pack_fields(fields: list[npt.NDArray[np.uint8]], pad: list[int]) -> npt.NDArray[np.uint8]:
    """Tiles of per-row-per-block fields [N, KB, size]: each field but the last as 32 rows of
    its bytes, then the last (the quants) in 128-byte groups of 4 bytes per row."""
    n, kb, _ = fields[0].shape
    npad = -(-n // 32) * 32
    parts = []
    for f, pv in zip(fields, pad):
        if npad != n:
            f = np.concatenate([f, np.full((npad - n, kb, f.shape[2]), pv, np.uint8)], axis=0)
        parts.append(f.reshape(npad // 32, 32, kb, f.shape[2]).transpose(0, 2, 1, 3))
    out = [p.reshape(npad // 32, kb, -1) for p in parts[:-1]]
    q = parts[-1]
    qb = q.shape[3]
    g = q.reshape(npad // 32, kb, 32, qb // 4, 4).transpose(0, 1, 3, 2, 4)
    out.append(g.reshape(npad // 32, kb, 32 * qb))
    return np.ascontiguousarray(np.concatenate(out, axis=2)).reshape(-1)


def _unpack_fields(
    buf: npt.ArrayLike, n: int, k: int, sizes: list[int], fmt: str
) -> list[npt.NDArray[np.uint8]]:
    nbytes = matrix_nbytes(fmt, n, k)
    a = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1)
    if a.dtype != np.uint8 or a.size < nbytes:
        raise FormatError(f"{fmt} W[{n}][{k}] needs {nbytes} uint8 bytes, got {a.size} {a.dtype}")
    nt, kb = -(-n // 32), k // 32
    t = a[:nbytes].reshape(nt, kb, -1)
    out, off = [], 0
    for fs in sizes[:-1]:
        f = t[..., off : off + 32 * fs].reshape(nt, kb, 32, fs).transpose(0, 2, 1, 3)
        out.append(np.ascontiguousarray(f.reshape(nt * 32, kb, fs)[:n]))
        off += 32 * fs
    qb = sizes[-1]
    g = t[..., off:].reshape(nt, kb, qb // 4, 32, 4).transpose(0, 3, 1, 2, 4)
    out.append(np.ascontiguousarray(g.reshape(nt * 32, kb, qb)[:n]))
    return out


def _check_k(k: int, fmt: str) -> None:
    if k <= 0 or k % QK_K:
        raise FormatError(f"{fmt} needs K a positive multiple of {QK_K}, got K={k}")


def pack_q4_k_t32r4(blocks: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """Q4_K blocks ``uint8[N, K/256, 144]`` (or ``[N, K/256*144]``) -> ``q4_k-t32r4``
    (lossless; padding rows have zero scales)."""
    return _pack_fields(_q4_k_fields(_kblocks(blocks, Q4_K_BLOCK_BYTES)), [0, 0, 0, 0, 0])


def pack_q5_k_t32r4(blocks: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """Q5_K blocks ``uint8[N, K/256, 176]`` -> ``q5_k-t32r4`` (lossless)."""
    return _pack_fields(_q5_k_fields(_kblocks(blocks, Q5_K_BLOCK_BYTES)), [0, 0, 0, 0, 0])


def pack_q6_k_t32r4(blocks: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """Q6_K blocks ``uint8[N, K/256, 210]`` -> ``q6_k-t32r4`` (lossless)."""
    return _pack_fields(_q6_k_fields(_kblocks(blocks, Q6_K_BLOCK_BYTES)), [0, 0, 0])


def unpack_q4_k_t32r4(buf: npt.ArrayLike, n: int, k: int) -> npt.NDArray[np.uint8]:
    """Inverse of :func:`pack_q4_k_t32r4`: Q4_K blocks ``uint8[n, k/256, 144]``."""
    _check_k(k, "q4_k-t32r4")
    return _q4_k_blocks(_unpack_fields(buf, n, k, [2, 2, 1, 1, 16], "q4_k-t32r4"))


def unpack_q5_k_t32r4(buf: npt.ArrayLike, n: int, k: int) -> npt.NDArray[np.uint8]:
    """Inverse of :func:`pack_q5_k_t32r4`: Q5_K blocks ``uint8[n, k/256, 176]``."""
    _check_k(k, "q5_k-t32r4")
    return _q5_k_blocks(_unpack_fields(buf, n, k, [2, 2, 1, 1, 20], "q5_k-t32r4"))


def unpack_q6_k_t32r4(buf: npt.ArrayLike, n: int, k: int) -> npt.NDArray[np.uint8]:
    """Inverse of :func:`pack_q6_k_t32r4`: Q6_K blocks ``uint8[n, k/256, 210]``."""
    _check_k(k, "q6_k-t32r4")
    return _q6_k_blocks(_unpack_fields(buf, n, k, [2, 2, 32], "q6_k-t32r4"))


def dequantize_q4_k(blocks: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """Q4_K blocks ``uint8[N, K/256, 144]`` -> ``float32[N, K]``: ``(d*sc)*q - dmin*m`` in
    float32, llama.cpp's dequantize_row_q4_K."""
    b = _kblocks(blocks, Q4_K_BLOCK_BYTES)
    d, dmin, sc, mn, nib = _q4_k_fields(b)
    f16 = lambda x: np.ascontiguousarray(x).view(np.float16)[..., 0].astype(np.float32)  # noqa: E731
    s = f16(d) * sc[..., 0].astype(np.float32)
    m = f16(dmin) * mn[..., 0].astype(np.float32)
    q = np.concatenate([nib & 15, nib >> 4], axis=2).astype(np.float32)
    return (s[..., None] * q - m[..., None]).reshape(b.shape[0], -1)


def dequantize_q5_k(blocks: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """Q5_K blocks ``uint8[N, K/256, 176]`` -> ``float32[N, K]``: ``(d*sc)*q - dmin*m`` in
    float32 with q = nibble + 16 x fifth bit (0..31), llama.cpp's dequantize_row_q5_K."""
    b = _kblocks(blocks, Q5_K_BLOCK_BYTES)
    d, dmin, sc, mn, q = _q5_k_fields(b)
    f16 = lambda x: np.ascontiguousarray(x).view(np.float16)[..., 0].astype(np.float32)  # noqa: E731
    s = f16(d) * sc[..., 0].astype(np.float32)
    m = f16(dmin) * mn[..., 0].astype(np.float32)
    nib = q[..., :16]
    words = np.ascontiguousarray(q[..., 16:20]).view("<u4")[..., 0]
    high = ((words[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    v = (np.concatenate([nib & 15, nib >> 4], axis=2) | high).astype(np.float32)
    return (s[..., None] * v - m[..., None]).reshape(b.shape[0], -1)


def dequantize_q6_k(blocks: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """Q6_K blocks ``uint8[N, K/256, 210]`` -> ``float32[N, K]``: ``(d*sc)*q`` in float32."""
    b = _kblocks(blocks, Q6_K_BLOCK_BYTES)
    d, sc, q = _q6_k_fields(b)
    dd = np.ascontiguousarray(d).view(np.float16)[..., 0].astype(np.float32)
    s = dd[..., None] * sc.view(np.int8).astype(np.float32)  # [N, KB, 2]
    qv = q.view(np.int8).astype(np.float32).reshape(*q.shape[:2], 2, 16)
    return (s[..., None] * qv).reshape(b.shape[0], -1)


# ---------------------------------------------------------------- MXFP4 tiles
# mxfp4-t32r4 (544 B): the 32 rows' E8M0 exponent bytes (row r at r), then the codes of each row
# in 4 groups of 128 B exactly as q4_0-t32r4 lays its nibbles (byte 4g+b of row r at
# 32 + 128g + 4r + b). Padding rows are all zero (exponent 0, codes 0: value 0).
MXFP4_KV = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def _e8m0_half(e: npt.NDArray[np.uint8]) -> npt.NDArray[np.float32]:
    """2^(e - 128) as float32, exactly (e = 0 and 1 give subnormals)."""
    e32 = e.astype(np.uint32)
    small = np.left_shift(np.uint32(1), e32 + np.uint32(21), dtype=np.uint32)
    big = np.left_shift(np.maximum(e32, 1) - np.uint32(1), np.uint32(23), dtype=np.uint32)
    return np.where(e32 < 2, small, big).astype(np.uint32).view(np.float32)


def quantize_mxfp4(w: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """MXFP4 blocks ``uint8[N, K/32, 17]`` of ``w[N, K]``: per block the exponent whose largest
    value (6 x 2^(e-127)) is the first to cover the block's largest magnitude, then each element
    to its nearest E2M1 value (ties to the smaller magnitude)."""
    x = _check_matrix(w).astype(np.float64)
    n, k = x.shape
    b = x.reshape(n, k // 32, 32)
    amax = np.abs(b).max(axis=2)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.ceil(np.log2(amax / 6.0)) + 127, 0)
    e = np.clip(e, 0, 254).astype(np.uint8)
    half = _e8m0_half(e).astype(np.float64)
    mags = np.array([0, 1, 2, 3, 4, 6, 8, 12], np.float64)
    rel = np.abs(b) / np.where(half > 0, half, 1.0)[..., None]
    code = np.abs(rel[..., None] - mags).argmin(axis=3).astype(np.uint8)
    code |= np.where((b < 0) & (code > 0), 8, 0).astype(np.uint8)
    out = np.empty((n, k // 32, 17), dtype=np.uint8)
    out[..., 0] = e
    out[..., 1:] = code[..., :16] | (code[..., 16:] << 4)
    return out


def dequantize_mxfp4(blocks: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """MXFP4 blocks ``uint8[N, K/32, 17]`` -> ``float32[N, K]`` (exact: llama.cpp's values)."""
    b = _blocks(blocks, 17)
    qs = b[..., 1:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=2)
    with np.errstate(over="ignore"):
        v = MXFP4_KV[codes].astype(np.float32) * _e8m0_half(b[..., 0])[..., None]
    return v.reshape(b.shape[0], -1)


def pack_mxfp4_t32r4(w: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """Pack into ``mxfp4-t32r4``: float ``[N, K]`` (quantized with :func:`quantize_mxfp4`) or
    MXFP4 blocks ``uint8[N, K/32, 17]`` / ``[N, K/32*17]`` (re-laid losslessly)."""
    a = np.asarray(w)
    b = _blocks(a, 17) if a.dtype == np.uint8 else quantize_mxfp4(a)
    return _pack_fields([b[..., :1], b[..., 1:]], [0, 0])


def unpack_mxfp4_t32r4(buf: npt.ArrayLike, n: int, k: int) -> npt.NDArray[np.uint8]:
    """Inverse of :func:`pack_mxfp4_t32r4`: MXFP4 blocks ``uint8[n, k/32, 17]``."""
    e, qs = _unpack_fields(buf, n, k, [1, 16], "mxfp4-t32r4")
    return np.concatenate([e, qs], axis=2)


# ---------------------------------------------------------------- IQ4_NL tiles
# iq4_nl-t32r4 is q4_0-t32r4's layout (an IQ4_NL block is a Q4_0 block whose 4-bit codes index a
# non-linear table instead of being nibble - 8); padding rows as Q4_0's: scale 0, bytes 0x88.
IQ4_NL_KV = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])


def dequantize_iq4_nl(blocks: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """IQ4_NL blocks ``uint8[N, K/32, 18]`` -> ``float32[N, K]``: ``d * kv[code]`` in float32."""
    b = _blocks(blocks, 18)
    d = np.ascontiguousarray(b[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    qs = b[..., 2:]
    q = IQ4_NL_KV[np.concatenate([qs & 15, qs >> 4], axis=2)].astype(np.float32)
    return (q * d[..., None]).reshape(b.shape[0], -1)


def pack_iq4_nl_t32r4(blocks: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """IQ4_NL blocks ``uint8[N, K/32, 18]`` (or ``[N, K/32*18]``) -> ``iq4_nl-t32r4``
    (lossless)."""
    return _pack(_blocks(blocks, 18), 16, 0x88)


def unpack_iq4_nl_t32r4(buf: npt.ArrayLike, n: int, k: int) -> npt.NDArray[np.uint8]:
    """Inverse of :func:`pack_iq4_nl_t32r4`: IQ4_NL blocks ``uint8[n, k/32, 18]``."""
    return _unpack(buf, n, k, 16, "iq4_nl-t32r4")


# ---------------------------------------------------------------- IQ4_XS tiles
# IQ4_XS block (136 B, 256 values): fp16 d, uint16 scales_h (bits 2j, 2j+1: the high two bits of
# sub-block j's 6-bit scale), scales_l[4] (nibble j % 2 of byte j // 2: the low four bits), then
# qs[128]: sub-block j's 32 codes in bytes 16j..16j+15, Q4_0's nibble order. Value = (d * (ls -
# 32)) * kv[code]. iq4_xs-t32r4 (608 B): per sub-block row the fp16 d (repeated), the int8
# ls - 32, then the 16 code bytes in 4-byte groups. Padding rows are all zero (d = 0: value 0).
def _iq4_xs_fields(b: npt.NDArray[np.uint8]) -> list[npt.NDArray[np.uint8]]:
    """IQ4_XS blocks [N, S, 136] -> per sub-block fields [N, 8S, *]: d, ls - 32, code bytes."""
    n, sb, _ = b.shape
    sh = np.ascontiguousarray(b[..., 2:4]).view("<u2")[..., 0].astype(np.uint32)  # [n, sb]
    hi = (sh[..., None] >> (2 * np.arange(8, dtype=np.uint32))) & 3  # [n, sb, 8]
    sl = b[..., 4:8]
    lo = np.stack([sl & 15, sl >> 4], axis=3).reshape(n, sb, 8).astype(np.uint32)
    ls = (lo | (hi << 4)).astype(np.int16) - 32
    sc = ls.astype(np.int8).view(np.uint8).reshape(n, sb * 8, 1)
    return [np.repeat(b[..., 0:2], 8, axis=1), sc, b[..., 8:].reshape(n, sb * 8, 16)]


def _iq4_xs_blocks(f: list[npt.NDArray[np.uint8]]) -> npt.NDArray[np.uint8]:
    d, sc, qs = f
    n, kb, _ = qs.shape
    sb = kb // 8
    ls = (sc.view(np.int8).astype(np.int16) + 32).astype(np.uint32).reshape(n, sb, 8)
    sh = ((ls >> 4) << (2 * np.arange(8, dtype=np.uint32))).sum(axis=2).astype("<u2")
    lo = (ls & 15).astype(np.uint8)
    sl = lo[..., 0::2] | (lo[..., 1::2] << 4)
    return np.concatenate(
        [d.reshape(n, sb, 8, 2)[:, :, 0], sh[..., None].view(np.uint8), sl, qs.reshape(n, sb, 128)],
        axis=2,
    ).astype(np.uint8)


def pack_iq4_xs_t32r4(blocks: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """IQ4_XS blocks ``uint8[N, K/256, 136]`` (or ``[N, K/256*136]``) -> ``iq4_xs-t32r4``
    (lossless)."""
    return _pack_fields(_iq4_xs_fields(_kblocks(blocks, IQ4_XS_BLOCK_BYTES)), [0, 0, 0])


def unpack_iq4_xs_t32r4(buf: npt.ArrayLike, n: int, k: int) -> npt.NDArray[np.uint8]:
    """Inverse of :func:`pack_iq4_xs_t32r4`: IQ4_XS blocks ``uint8[n, k/256, 136]``."""
    _check_k(k, "iq4_xs-t32r4")
    return _iq4_xs_blocks(_unpack_fields(buf, n, k, [2, 1, 16], "iq4_xs-t32r4"))


def dequantize_iq4_xs(blocks: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """IQ4_XS blocks ``uint8[N, K/256, 136]`` -> ``float32[N, K]``: ``(d * (ls - 32)) *
    kv[code]`` in float32, llama.cpp's dequantize_row_iq4_xs."""
    b = _kblocks(blocks, IQ4_XS_BLOCK_BYTES)
    d, sc, qs = _iq4_xs_fields(b)
    s = np.ascontiguousarray(d).view(np.float16)[..., 0].astype(np.float32)
    s = s * sc[..., 0].view(np.int8).astype(np.float32)
    q = IQ4_NL_KV[np.concatenate([qs & 15, qs >> 4], axis=2)].astype(np.float32)
    return (s[..., None] * q).reshape(b.shape[0], -1)


# ---------------------------------------------------------------- Q4_1 / Q5_0 / Q5_1 tiles
# Blocks: Q4_1 (20 B) fp16 d, fp16 m, qs[16]; Q5_0 (22 B) fp16 d, qh (uint32 LE, bit c = the
# fifth bit of element c), qs[16]; Q5_1 (24 B) d, m, qh, qs. qs in Q4_0's nibble order; q = nibble
# + 16 x fifth bit; value = d*q + m (Q4_1, Q5_1), d*(q - 16) (Q5_0). Tiles: the header bytes
# (d or the (d, m) pair) of each row, then the rest in 4-byte groups (Q5_x: the qh word first).
_AFF = {"q4_1-t32r4": (20, 4), "q5_0-t32r4": (22, 2), "q5_1-t32r4": (24, 4)}  # block, header


def pack_q4_1_q5_t32r4(blocks: npt.ArrayLike, fmt: str) -> npt.NDArray[np.uint8]:
    """Q4_1 / Q5_0 / Q5_1 blocks ``uint8[N, K/32, block]`` -> ``fmt`` tiles (lossless)."""
    size, hdr = _AFF[fmt]
    b = _blocks(blocks, size)
    return _pack_fields([b[..., :hdr], b[..., hdr:]], [0, 0])


def unpack_q4_1_q5_t32r4(buf: npt.ArrayLike, fmt: str, n: int, k: int) -> npt.NDArray[np.uint8]:
    """Inverse of :func:`pack_q4_1_q5_t32r4`."""
    size, hdr = _AFF[fmt]
    h, q = _unpack_fields(buf, n, k, [hdr, size - hdr], fmt)
    return np.concatenate([h, q], axis=2)


def dequantize_q4_1_q5(blocks: npt.ArrayLike, fmt: str) -> npt.NDArray[np.float32]:
    """Q4_1 / Q5_0 / Q5_1 blocks -> ``float32[N, K]`` (llama.cpp's dequantize_row_q4_1/q5_0/q5_1,
    in float32: d*q + m, or d*(q - 16))."""
    size, hdr = _AFF[fmt]
    b = _blocks(blocks, size)
    d = np.ascontiguousarray(b[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    qs = b[..., -16:]
    q = np.concatenate([qs & 15, qs >> 4], axis=2).astype(np.int32)
    if fmt != "q4_1-t32r4":
        qh = np.ascontiguousarray(b[..., hdr : hdr + 4]).view("<u4")[..., 0]
        q |= (((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.int32)
    if fmt == "q5_0-t32r4":
        v = d[..., None] * (q - 16).astype(np.float32)
    else:
        m = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
        v = d[..., None] * q.astype(np.float32) + m[..., None]
    return v.reshape(b.shape[0], -1)


# f16-t32r4 / bf16-t32r4 (2048 B, no header): group g (128 B) holds, for rows 0..31, the row's
# 16-bit values of columns 2g and 2g+1; padding rows are zero.
def pack_f16_t32r4(values: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """16-bit values ``uint16[N, K]`` (F16 or BF16 bit patterns, ``K % 32 == 0``) ->
    ``f16-t32r4`` / ``bf16-t32r4`` tiles (the two share the byte layout; lossless)."""
    v = np.asarray(values)
    if v.dtype != np.uint16 or v.ndim != 2 or v.shape[0] == 0 or v.shape[1] % 32 or not v.size:
        raise FormatError(f"expected uint16[N, K] with K a multiple of 32, got {v.dtype} {v.shape}")
    b = np.ascontiguousarray(v).view(np.uint8).reshape(v.shape[0], v.shape[1] // 32, 64)
    return _pack_fields([b], [0])


def dequantize_f16_t32r4(buf: npt.ArrayLike, fmt: str, n: int, k: int) -> npt.NDArray[np.float32]:
    """``float32[n, k]`` values of ``f16-t32r4`` (IEEE half) or ``bf16-t32r4`` (bfloat16) tiles,
    each converted exactly."""
    (b,) = _unpack_fields(buf, n, k, [64], fmt)
    u = np.ascontiguousarray(b).view("<u2").reshape(n, k)
    if fmt == "f16-t32r4":
        return u.view(np.float16).astype(np.float32)
    return (u.astype(np.uint32) << np.uint32(16)).view(np.float32)


def dequantize_tiles(buf: npt.ArrayLike, fmt: str, n: int, k: int) -> npt.NDArray[np.float32]:
    """``float32[n, k]`` values of a tile-format matrix (padding rows dropped)."""
    if fmt in FLOAT_TILE_FORMATS:
        return dequantize_f16_t32r4(buf, fmt, n, k)
    if fmt == "q4_0-t32r4":
        return dequantize_q4_0(unpack_q4_0_t32r4(buf, n, k))
    if fmt == "q8_0-t32r4":
        return dequantize_q8_0(unpack_q8_0_t32r4(buf, n, k))
    if fmt == "q4_k-t32r4":
        return dequantize_q4_k(unpack_q4_k_t32r4(buf, n, k))
    if fmt == "q5_k-t32r4":
        return dequantize_q5_k(unpack_q5_k_t32r4(buf, n, k))
    if fmt == "q6_k-t32r4":
        return dequantize_q6_k(unpack_q6_k_t32r4(buf, n, k))
    if fmt == "mxfp4-t32r4":
        return dequantize_mxfp4(unpack_mxfp4_t32r4(buf, n, k))
    if fmt == "iq4_nl-t32r4":
        return dequantize_iq4_nl(unpack_iq4_nl_t32r4(buf, n, k))
    if fmt == "iq4_xs-t32r4":
        return dequantize_iq4_xs(unpack_iq4_xs_t32r4(buf, n, k))
    if fmt in _AFF:
        return dequantize_q4_1_q5(unpack_q4_1_q5_t32r4(buf, fmt, n, k), fmt)
    raise FormatError(f"unknown tile format {fmt!r}; expected one of {sorted(TILE_FORMATS)}")
