"""Tile-major weight formats `q4_0-t32r4`, `q8_0-t32r4`, `mxfp4-t32r4` and the K-quant ones
(docs/design.md §4, docs/format.md).

A matrix `W[N][K]` stored as GGML blocks (one block = 32 consecutive elements of a row: an fp16
scale then the quants) is cut into 32x32 tiles, output-tile major, reduction-tile minor. A tile
holds the 32 row scales (64 B; MXFP4's one-byte E8M0 exponents: 32 B) and then the quants of its 32 rows interleaved in 4-byte pieces:
group `g` (128 B) = bytes `4g..4g+3` of each row's quants, rows 0..31 in order. One group is one
HVX vector / two AVX-512 registers whose 32-bit lanes are rows.

Everything here is vectorised numpy: the conversion is a strided gather of 2-byte scales and
4-byte quant pieces, expressed as two array assignments between views (no per-block Python).
"""

from __future__ import annotations

from typing import Final

import attrs
import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

__all__ = [
    "BF16_T32R4",
    "F16_T32R4",
    "FORMATS",
    "IQ4_NL_KVALUES",
    "IQ4_NL_T32R4",
    "IQ4_XS_T32R4",
    "MXFP4_KVALUES",
    "MXFP4_MAX_EXPONENT",
    "MXFP4_T32R4",
    "Q4_0_T32R4",
    "Q4_1_T32R4",
    "Q4_K_T32R4",
    "Q5_0_T32R4",
    "Q5_1_T32R4",
    "Q5_K_T32R4",
    "Q6_K_T32R4",
    "Q8_0_T32R4",
    "TILE",
    "TileFormat",
    "dequantize_blocks",
    "dequantize_tiles",
    "e8m0_to_fp32_half",
    "pack_tiles",
    "pad_rows",
    "quantize_mxfp4",
    "quantize_q4_0",
    "quantize_q8_0",
    "tile_format",
    "tile_nbytes",
    "unpack_tiles",
]

TILE: Final = 32  # rows per tile and elements per GGML block (the reduction extent of a tile)


@attrs.frozen
class TileFormat:
    """One tile-major format: which GGML block it re-lays and how big its pieces are."""

    name: str
    ggml_type: GGMLQuantizationType
    block_bytes: int  # bytes of one GGML block (fp16 scale + quants; a K-quant super-block)
    n_groups: int  # 128-byte quant groups per tile
    pad_quant_byte: int  # quant byte of a padding row (its scale is 0)
    header_bytes: int = 2 * TILE  # per-row scales before the groups (32 rows' worth)
    block_elems: int = TILE  # elements of one GGML block (256 for K-quant super-blocks)
    scale_bytes: int = 2  # bytes of a block's scale (fp16; MXFP4's E8M0 exponent: 1)

    @property
    def tile_bytes(self) -> int:
        return self.header_bytes + self.n_groups * 4 * TILE

    @property
    def quant_bytes(self) -> int:
        return self.block_bytes - self.scale_bytes


Q4_0_T32R4: Final = TileFormat("q4_0-t32r4", GGMLQuantizationType.Q4_0, 18, 4, 0x88)
Q8_0_T32R4: Final = TileFormat("q8_0-t32r4", GGMLQuantizationType.Q8_0, 34, 8, 0x00)
# K-quants: one tile row per 32-element sub-block, the super-block's scales expanded per row
# (docs/format.md §1): q4_k = d, dmin (fp16), sc, m (uint8) per row, then Q4_0-order nibbles;
# q6_k = d (fp16), two int8 scales per row, then int8 values q - 32.
Q4_K_T32R4: Final = TileFormat(
    "q4_k-t32r4", GGMLQuantizationType.Q4_K, 144, 4, 0, header_bytes=6 * TILE, block_elems=256
)
Q6_K_T32R4: Final = TileFormat(
    "q6_k-t32r4", GGMLQuantizationType.Q6_K, 210, 8, 0, header_bytes=4 * TILE, block_elems=256
)
# q5_k: q4_k's header and nibbles, then a fifth group: each row's 32 fifth bits as one
# little-endian 32-bit word (bit c = column c's 16).
Q5_K_T32R4: Final = TileFormat(
    "q5_k-t32r4", GGMLQuantizationType.Q5_K, 176, 5, 0, header_bytes=6 * TILE, block_elems=256
)
# MXFP4 (OCP microscaling, gpt-oss's experts): a 17-byte block of 32 = one E8M0 exponent byte,
# then 16 bytes of FP4 E2M1 codes in Q4_0's nibble order; the tile holds the 32 exponent bytes
# then the nibbles exactly as Q4_0 tiles do (docs/format.md §1).
MXFP4_T32R4: Final = TileFormat(
    "mxfp4-t32r4", GGMLQuantizationType.MXFP4, 17, 4, 0x00, header_bytes=TILE, scale_bytes=1
)
# IQ4_NL: Q4_0's block and tile layout (padding rows too: scale 0, codes 0x88); the 4-bit
# codes index a non-linear table.
IQ4_NL_T32R4: Final = TileFormat("iq4_nl-t32r4", GGMLQuantizationType.IQ4_NL, 18, 4, 0x88)
# Q4_1 / Q5_1: the block's fp16 (d, m) pair is the row's 4-byte "scale" (at 4r); Q5_0 / Q5_1:
# the block's 32 fifth bits (qh, a little-endian word) are the first 4-byte group, the nibbles
# follow in Q4_0's order. Padding rows are all zero (d = m = 0: value 0).
Q4_1_T32R4: Final = TileFormat(
    "q4_1-t32r4", GGMLQuantizationType.Q4_1, 20, 4, 0, header_bytes=4 * TILE, scale_bytes=4
)
Q5_0_T32R4: Final = TileFormat("q5_0-t32r4", GGMLQuantizationType.Q5_0, 22, 5, 0)
Q5_1_T32R4: Final = TileFormat(
    "q5_1-t32r4", GGMLQuantizationType.Q5_1, 24, 5, 0, header_bytes=4 * TILE, scale_bytes=4
)
# IQ4_XS: a 136-byte super-block of 256 (fp16 d, 6-bit sub-block scales ls split into scales_h
# and scales_l, IQ4_NL codes); one tile row per 32-element sub-block: the fp16 d (repeated),
# the int8 ls - 32, then the codes in Q4_0's nibble order (docs/format.md §1).
IQ4_XS_T32R4: Final = TileFormat(
    "iq4_xs-t32r4", GGMLQuantizationType.IQ4_XS, 136, 4, 0, header_bytes=3 * TILE, block_elems=256
)
# F16 / BF16: no scale; a "block" is 32 consecutive 16-bit values of a row (64 B), so a tile
# is 16 groups: group g = values 2g, 2g+1 of each row (a little-endian 32-bit word), rows
# 0..31 in order (docs/format.md §1). Padding rows are all zero (value +0.0).
F16_T32R4: Final = TileFormat(
    "f16-t32r4", GGMLQuantizationType.F16, 64, 16, 0, header_bytes=0, scale_bytes=0
)
BF16_T32R4: Final = TileFormat(
    "bf16-t32r4", GGMLQuantizationType.BF16, 64, 16, 0, header_bytes=0, scale_bytes=0
)
FORMATS: Final = {
    f.name: f
    for f in (
        Q4_0_T32R4, Q8_0_T32R4, Q4_K_T32R4, Q5_K_T32R4, Q6_K_T32R4, MXFP4_T32R4, IQ4_NL_T32R4,
        Q4_1_T32R4, Q5_0_T32R4, Q5_1_T32R4, IQ4_XS_T32R4, F16_T32R4, BF16_T32R4,
    )
}  # fmt: skip
# llama.cpp's kvalues_iq4nl: the int8 value of each IQ4_NL code (value = d * IQ4_NL_KVALUES[code]).
IQ4_NL_KVALUES: Final = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8
)
# The E2M1 value of each 4-bit code, doubled (so they are integers): codes 0..7 are
# 0, 0.5, 1, 1.5, 2, 3, 4, 6 and 8..15 their negatives. A block's value is code value x 2 x
# 2^(e - 128), i.e. the doubled value times half the E8M0 scale 2^(e - 127).
MXFP4_KVALUES: Final = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)
# The largest E8M0 exponent a pack accepts: every value of its block is finite in float32
# (at most 12 x 2^(252 - 128) = 1.5 x 2^127); from 253 values overflow, and 255 is OCP's NaN.
MXFP4_MAX_EXPONENT: Final = 252


def tile_format(fmt: str | TileFormat) -> TileFormat:
    """Look a format up by name (`"q4_0-t32r4"` or `"q8_0-t32r4"`)."""
    if isinstance(fmt, TileFormat):
        return fmt
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown tile format {fmt!r}; known: {sorted(FORMATS)}") from None


def _ceil_tiles(n: int) -> int:
    return -(-n // TILE)


def tile_nbytes(n_rows: int, n_cols: int, fmt: str | TileFormat = "q4_0-t32r4") -> int:
    """Bytes of an `N x K` matrix in a tile format: `ceil(N/32) * (K/32) * tile_bytes`."""
    f = tile_format(fmt)
    if n_cols % f.block_elems:
        raise ValueError(f"reduction dimension K={n_cols} is not a multiple of {f.block_elems}")
    return _ceil_tiles(n_rows) * (n_cols // TILE) * f.tile_bytes


def _as_rows(blocks: np.ndarray, f: TileFormat, n_rows: int | None) -> np.ndarray:
    """View GGML block bytes as `[..., N, row_bytes]` uint8 (no copy when already contiguous)."""
    a = np.ascontiguousarray(blocks)
    if a.dtype != np.uint8:
        raise TypeError(f"expected raw GGML block bytes (uint8), got {a.dtype}")
    if a.ndim == 1:
        if n_rows is None:
            raise ValueError("flat block bytes need n_rows")
        a = a.reshape(n_rows, -1)
    if a.shape[-1] % f.block_bytes:
        raise ValueError(
            f"row of {a.shape[-1]} bytes is not a whole number of {f.ggml_type.name} blocks "
            f"({f.block_bytes} B)"
        )
    return a


def pad_rows(rows: np.ndarray, fmt: str | TileFormat = "q4_0-t32r4") -> np.ndarray:
    """Append padding rows (scale 0, quants = the format's pad byte) up to a multiple of 32."""
    f = tile_format(fmt)
    n = rows.shape[-2]
    n_pad = _ceil_tiles(n) * TILE
    if n_pad == n:
        return rows
    out = np.empty((*rows.shape[:-2], n_pad, rows.shape[-1]), dtype=np.uint8)
    out[..., :n, :] = rows
    blocks = out.reshape(*rows.shape[:-2], n_pad, -1, f.block_bytes)  # a view: out is contiguous
    blocks[..., n:, :, : f.scale_bytes] = 0
    blocks[..., n:, :, f.scale_bytes :] = f.pad_quant_byte
    return out


def _views(
    src_rows: np.ndarray, tiles: np.ndarray, f: TileFormat, n_tiles_total: int, kb: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Strided views pairing source block pieces with their places in the tile buffer (the
    scales are `scale_bytes` wide, the quant pieces 4 bytes).

    `src_rows` is `[n_tiles_total*32, kb*block_bytes]` contiguous uint8, `tiles` is
    `[n_tiles_total*kb*tile_bytes]` contiguous uint8. Returns (src_scales, dst_scales,
    src_quants, dst_quants) with identical shapes, so `dst[...] = src` (or the reverse) converts.
    """
    rb = kb * f.block_bytes
    tb = f.tile_bytes
    g = f.n_groups
    sb = src_rows.reshape(-1)
    sdt = {0: "u1", 1: "u1", 2: "<u2", 4: "<u4"}[f.scale_bytes]
    n_s = TILE if f.scale_bytes else 0  # F16 / BF16 tiles have no scales
    # source: [tile i, block j, row r] scales (u2; u1) and [i, j, group, r] quant pieces (u4)
    src_s = np.ndarray(
        (n_tiles_total, kb, n_s),
        dtype=sdt,
        buffer=sb,
        offset=0,
        strides=(TILE * rb, f.block_bytes, rb),
    )
    src_q = np.ndarray(
        (n_tiles_total, kb, g, TILE),
        dtype="<u4",
        buffer=sb,
        offset=f.scale_bytes,
        strides=(TILE * rb, f.block_bytes, 4, rb),
    )
    tbuf = tiles.reshape(-1)
    sbytes = f.scale_bytes
    dst_s = np.ndarray(
        (n_tiles_total, kb, n_s), dtype=sdt, buffer=tbuf, offset=0, strides=(kb * tb, tb, sbytes)
    )
    dst_q = np.ndarray(
        (n_tiles_total, kb, g, TILE),
        dtype="<u4",
        buffer=tbuf,
        offset=f.header_bytes,
        strides=(kb * tb, tb, 4 * TILE, 4),
    )
    return src_s, dst_s, src_q, dst_q


# ------------------------------------------------------------------ K-quant super-blocks
def _kq_split(sb: np.ndarray, f: TileFormat) -> list[np.ndarray]:
    """Super-blocks `[M, S, block_bytes]` -> the per-row fields of their 8*S sub-blocks, each
    `[M, 8S, size]` uint8, the quants last (Q4_K: d, dmin, sc, m, nibbles; Q5_K: the same
    with the fifth bits' word after the nibbles; Q6_K: d, scale pair, values; IQ4_XS: d,
    ls - 32, codes)."""
    m, s, _ = sb.shape
    if f is IQ4_XS_T32R4:  # d; ls - 32 from scales_h (2 bits per sub-block) and scales_l (4)
        sh = sb[..., 2:4].copy().view("<u2").astype(np.uint32)  # [m, s, 1]
        hi = (sh >> (2 * np.arange(8, dtype=np.uint32))) & 3  # [m, s, 8]
        lo = np.stack([sb[..., 4:8] & 15, sb[..., 4:8] >> 4], axis=-1).reshape(m, s, 8)
        ls = (lo | (hi << 4)).astype(np.int16) - 32
        return [
            np.repeat(sb[..., 0:2], 8, axis=1),
            ls.astype(np.int8).view(np.uint8).reshape(m, 8 * s, 1),
            sb[..., 8:].reshape(m, 8 * s, 16),
        ]
    if f is Q4_K_T32R4 or f is Q5_K_T32R4:
        packed = sb[..., 4:16].reshape(m, s, 3, 4)
        a, b, c = packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]
        sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
        mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
        qs = sb[..., -128:].reshape(m, s, 4, 32)
        v = np.stack([qs & 15, qs >> 4], axis=3).reshape(m, 8 * s, 32)  # sub-block 2p + nibble
        quants = v[..., :16] | (v[..., 16:] << 4)
        if f is Q5_K_T32R4:  # qh[l] bit j: the fifth bit of element l of sub-block j
            qh = sb[..., 16:48].reshape(m, s, 1, 32)
            hb = (qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1  # [m, s, j, l]
            words = np.packbits(hb.reshape(m, 8 * s, 32), axis=-1, bitorder="little")
            quants = np.concatenate([quants, words], axis=-1)
        return [
            np.repeat(sb[..., 0:2], 8, axis=1),
            np.repeat(sb[..., 2:4], 8, axis=1),
            sc.reshape(m, 8 * s, 1),
            mn.reshape(m, 8 * s, 1),
            quants,
        ]
    ql = sb[..., :128].reshape(m, s, 2, 2, 32)  # [half, which 32 of the 64, l]
    qh = sb[..., 128:192].reshape(m, s, 2, 1, 32)
    hi = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3  # [half, j, l]
    lo = np.concatenate([ql & 15, ql >> 4], axis=3).reshape(m, s, 2, 4, 32)
    q = (lo | (hi << 4)).astype(np.int16) - 32
    return [
        np.repeat(sb[..., 208:210], 8, axis=1),
        sb[..., 192:208].reshape(m, 8 * s, 2),
        q.astype(np.int8).view(np.uint8).reshape(m, 8 * s, 32),
    ]


def _kq_join(fields: list[np.ndarray], f: TileFormat) -> np.ndarray:
    """Inverse of `_kq_split`: super-blocks `[M, S, block_bytes]`."""
    q = fields[-1]
    m, kb, _ = q.shape
    s = kb // 8
    if f is IQ4_XS_T32R4:
        d, sc, qs = fields
        ls = (sc.view(np.int8).astype(np.int16) + 32).astype(np.uint32).reshape(m, s, 8)
        sh = ((ls >> 4) << (2 * np.arange(8, dtype=np.uint32))).sum(axis=-1).astype("<u2")
        lo = (ls & 15).astype(np.uint8)
        sl = lo[..., 0::2] | (lo[..., 1::2] << 4)
        parts = [d[:, ::8], sh[..., None].view(np.uint8), sl, qs.reshape(m, s, 128)]
        return np.concatenate(parts, axis=-1).astype(np.uint8)
    if f is Q4_K_T32R4 or f is Q5_K_T32R4:
        d, dmin, sc, mn, nib = fields
        high = None
        if f is Q5_K_T32R4:
            hb = np.unpackbits(nib[..., 16:20], axis=-1, bitorder="little").reshape(m, s, 8, 32)
            high = (hb << np.arange(8, dtype=np.uint8).reshape(8, 1)).sum(axis=2, dtype=np.uint8)
            nib = nib[..., :16]
        v = np.concatenate([nib & 15, nib >> 4], axis=-1).reshape(m, s, 4, 2, 32)
        qs = v[:, :, :, 0] | (v[:, :, :, 1] << 4)
        sc, mn = sc.reshape(m, s, 8), mn.reshape(m, s, 8)
        a = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
        b = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
        c = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
        parts = [d[:, ::8], dmin[:, ::8], a, b, c, qs.reshape(m, s, 128)]
        if high is not None:
            parts.insert(5, high)
    else:
        d, sc, vals = fields
        u = (vals.view(np.int8).astype(np.int16) + 32).astype(np.uint8).reshape(m, s, 2, 4, 32)
        ql = (u[:, :, :, :2] & 15) | ((u[:, :, :, 2:] & 15) << 4)
        h = u >> 4
        qh = h[:, :, :, 0] | (h[:, :, :, 1] << 2) | (h[:, :, :, 2] << 4) | (h[:, :, :, 3] << 6)
        parts = [ql.reshape(m, s, 128), qh.reshape(m, s, 64), sc.reshape(m, s, 16), d[:, ::8]]
    return np.concatenate(parts, axis=-1).astype(np.uint8)


def _kq_check(n_cols: int, f: TileFormat) -> None:
    if n_cols % f.block_elems:
        raise ValueError(f"reduction dimension K={n_cols} is not a multiple of {f.block_elems}")


def _kq_pack(rows: np.ndarray, f: TileFormat) -> np.ndarray:
    """`[..., N, S*block_bytes]` K-quant rows -> `[B, tile bytes of one matrix]`."""
    n = rows.shape[-2]
    s = rows.shape[-1] // f.block_bytes
    nb = int(np.prod(rows.shape[:-2], dtype=np.int64))
    fields = _kq_split(rows.reshape(nb * n, s, f.block_bytes), f)
    nt = _ceil_tiles(n)
    kb = 8 * s
    pieces = []
    for x in fields:
        x = x.reshape(nb, n, kb, x.shape[-1])
        if nt * TILE != n:  # padding rows: every field 0 (scales 0: the row's values are 0)
            x = np.concatenate([x, np.zeros((nb, nt * TILE - n, kb, x.shape[-1]), np.uint8)], 1)
        pieces.append(x.reshape(nb, nt, TILE, kb, -1).transpose(0, 1, 3, 2, 4))  # [b,i,j,r,*]
    q = pieces.pop()
    grouped = q.reshape(nb, nt, kb, TILE, -1, 4).transpose(0, 1, 2, 4, 3, 5)  # [b,i,j,g,r,4]
    out = [p.reshape(nb, nt, kb, -1) for p in pieces] + [grouped.reshape(nb, nt, kb, -1)]
    return np.concatenate(out, axis=-1).reshape(nb, -1)


def _kq_unpack(a: np.ndarray, n_mats: int, n_rows: int, n_cols: int, f: TileFormat) -> np.ndarray:
    nt, kb = _ceil_tiles(n_rows), n_cols // TILE
    t = a.reshape(n_mats, nt, kb, f.tile_bytes)
    sizes = {Q6_K_T32R4: [2, 2], IQ4_XS_T32R4: [2, 1]}.get(f, [2, 2, 1, 1])
    fields, off = [], 0
    for size in sizes:
        x = t[..., off : off + TILE * size].reshape(n_mats, nt, kb, TILE, size)
        fields.append(x.transpose(0, 1, 3, 2, 4).reshape(n_mats, nt * TILE, kb, size))
        off += TILE * size
    qb = f.n_groups * 4
    g = t[..., off:].reshape(n_mats, nt, kb, f.n_groups, TILE, 4).transpose(0, 1, 4, 2, 3, 5)
    fields.append(g.reshape(n_mats, nt * TILE, kb, qb))
    fields = [x[:, :n_rows].reshape(n_mats * n_rows, kb, -1) for x in fields]
    return _kq_join(fields, f).reshape(n_mats, n_rows, -1)


def pack_tiles(
    blocks: np.ndarray,
    fmt: str | TileFormat = "q4_0-t32r4",
    *,
    n_rows: int | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Re-lay GGML blocks of `W[N][K]` (or a batch `[..., N, K]`) into tile-major bytes.

    `blocks` is uint8: `[..., N, K/32*block_bytes]` (as GGUF stores it), or flat bytes with
    `n_rows`. Rows are padded to a multiple of 32 with (scale 0, quants 0x88/0) blocks (value 0).
    Returns uint8 `[..., tile_nbytes(N, K)]` (1-D for a single matrix). Lossless:
    `unpack_tiles(pack_tiles(b), N, K) == b` bit for bit.
    """
    f = tile_format(fmt)
    rows = _as_rows(blocks, f, n_rows)
    batch = rows.shape[:-2]
    n = rows.shape[-2]
    kb = rows.shape[-1] // f.block_bytes
    if f.block_elems != TILE:  # K-quant super-blocks: split into per-row sub-block fields
        nbytes = _ceil_tiles(n) * kb * (f.block_elems // TILE) * f.tile_bytes
        if out is None:
            out = np.empty((*batch, nbytes), dtype=np.uint8)
        elif out.dtype != np.uint8 or out.size != nbytes * max(1, int(np.prod(batch))):
            raise ValueError(f"out must be uint8 with {nbytes} bytes per matrix")
        if n and kb:
            out.reshape(-1, nbytes)[...] = _kq_pack(rows, f)
        return out
    rows = pad_rows(rows, f)  # no-op (no copy) when N % 32 == 0
    n_tiles_total = int(np.prod(batch, dtype=np.int64)) * (rows.shape[-2] // TILE)
    nbytes = _ceil_tiles(n) * kb * f.tile_bytes
    if out is None:
        out = np.empty((*batch, nbytes), dtype=np.uint8)
    elif out.dtype != np.uint8 or out.size != nbytes * max(1, int(np.prod(batch))):
        raise ValueError(f"out must be uint8 with {nbytes} bytes per matrix")
    if n_tiles_total == 0 or kb == 0:
        return out
    src_s, dst_s, src_q, dst_q = _views(rows, out, f, n_tiles_total, kb)
    dst_s[...] = src_s
    dst_q[...] = src_q
    return out


def unpack_tiles(
    buf: np.ndarray | bytes | memoryview,
    n_rows: int,
    n_cols: int,
    fmt: str | TileFormat = "q4_0-t32r4",
) -> np.ndarray:
    """Inverse of `pack_tiles`: tile-major bytes of `W[N][K]` (or a batch) -> GGML block rows.

    Returns uint8 `[..., N, K/32*block_bytes]` (padding rows dropped); a leading batch axis is
    inferred when `buf` holds several matrices back to back.
    """
    f = tile_format(fmt)
    if n_cols % TILE:
        raise ValueError(f"reduction dimension K={n_cols} is not a multiple of {TILE}")
    a = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    a = np.ascontiguousarray(a).reshape(-1)
    one = tile_nbytes(n_rows, n_cols, f)
    if one == 0:
        return np.empty((n_rows, 0), dtype=np.uint8)
    if a.size % one:
        raise ValueError(f"buffer of {a.size} B is not a whole number of {one}-B matrices")
    n_mats = a.size // one
    if f.block_elems != TILE:
        _kq_check(n_cols, f)
        rows = _kq_unpack(a, n_mats, n_rows, n_cols, f)
        return rows[0] if (np.ndim(buf) <= 1 and n_mats == 1) else rows
    kb = n_cols // TILE
    nt = _ceil_tiles(n_rows)
    rows = np.empty((n_mats, nt * TILE, kb * f.block_bytes), dtype=np.uint8)
    src_s, dst_s, src_q, dst_q = _views(rows, a, f, n_mats * nt, kb)
    src_s[...] = dst_s
    src_q[...] = dst_q
    rows = rows[:, :n_rows, :]
    return rows[0] if (np.ndim(buf) <= 1 and n_mats == 1) else rows


def _scales(rows: np.ndarray, f: TileFormat) -> tuple[np.ndarray, np.ndarray]:
    b = rows.reshape(*rows.shape[:-1], -1, f.block_bytes)
    d = b[..., :2].copy().view("<f2")[..., 0].astype(np.float32)
    return b, d


def e8m0_to_fp32_half(e: np.ndarray) -> np.ndarray:
    """Half the E8M0 scale, 2^(e - 128), as float32 (exact: subnormal for e = 0, 1), the
    factor llama.cpp applies to the doubled E2M1 values."""
    e = np.asarray(e, dtype=np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def dequantize_blocks(rows: np.ndarray, fmt: str | TileFormat = "q4_0-t32r4") -> np.ndarray:
    """GGML block rows `[..., N, K/32*bs]` (Q4_0, Q8_0, MXFP4; Q4_K / Q6_K `[..., N, K/256*bs]`;
    F16 / BF16 `[..., N, 2K]` bytes) -> float32 `[..., N, K]` (exact; K-quants through gguf-py's
    dequantize, llama.cpp's rule)."""
    f = tile_format(fmt)
    if f is F16_T32R4:
        return np.ascontiguousarray(rows).view("<f2").astype(np.float32)
    if f is BF16_T32R4:  # the 16 high bits of a float32
        u = np.ascontiguousarray(rows).view("<u2").astype(np.uint32) << np.uint32(16)
        return u.view(np.float32)
    if f.block_elems != TILE or f in (Q4_1_T32R4, Q5_0_T32R4, Q5_1_T32R4):
        w = gguf_quants.dequantize(np.ascontiguousarray(rows), f.ggml_type)
        return np.asarray(w, dtype=np.float32)
    if f is MXFP4_T32R4:
        b = rows.reshape(*rows.shape[:-1], -1, f.block_bytes)
        qs = b[..., 1:]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        with np.errstate(over="ignore"):  # exponents >= 253 overflow float32, as in llama.cpp
            w = MXFP4_KVALUES[codes].astype(np.float32) * e8m0_to_fp32_half(b[..., 0])[..., None]
        return w.reshape(*rows.shape[:-1], -1)
    b, d = _scales(rows, f)
    qs = b[..., 2:]
    if f is Q4_0_T32R4:
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int8) - 8
    elif f is IQ4_NL_T32R4:
        q = IQ4_NL_KVALUES[np.concatenate([qs & 0x0F, qs >> 4], axis=-1)]
    else:
        q = qs.view(np.int8)
    w = q.astype(np.float32) * d[..., None]
    return w.reshape(*rows.shape[:-1], -1)


def dequantize_tiles(
    buf: np.ndarray | bytes | memoryview,
    n_rows: int,
    n_cols: int,
    fmt: str | TileFormat = "q4_0-t32r4",
) -> np.ndarray:
    """Tile-major bytes -> float32 `W[N][K]` (the values a kernel must reproduce)."""
    return dequantize_blocks(unpack_tiles(buf, n_rows, n_cols, fmt), fmt)


def quantize_q4_0(w: np.ndarray) -> np.ndarray:
    """float `[..., N, K]` -> GGML Q4_0 block rows `[..., N, K/32*18]` (ggml's reference rounding)."""
    w = np.asarray(w, dtype=np.float32)
    if w.shape[-1] % TILE:
        raise ValueError(f"K={w.shape[-1]} is not a multiple of {TILE}")
    return np.asarray(gguf_quants.quantize(w, GGMLQuantizationType.Q4_0), dtype=np.uint8)


def quantize_mxfp4(w: np.ndarray) -> np.ndarray:
    """float `[..., N, K]` -> GGML MXFP4 block rows `[..., N, K/32*17]`.

    Per block of 32: the smallest exponent `e` whose largest value, 6 x 2^(e - 127), covers
    the block's largest magnitude (no clipping; `e` = 0 for an all-zero block), then each
    element's magnitude to the nearest E2M1 value (ties to the smaller one), with its sign."""
    w = np.asarray(w, dtype=np.float32)
    if w.shape[-1] % TILE:
        raise ValueError(f"K={w.shape[-1]} is not a multiple of {TILE}")
    if not np.isfinite(w).all():
        raise ValueError("MXFP4 quantization needs finite weights")
    b = w.reshape(*w.shape[:-1], -1, TILE).astype(np.float64)
    amax = np.abs(b).max(axis=-1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.ceil(np.log2(amax / 6.0)) + 127, 0)
    e = np.clip(e, 0, 254).astype(np.uint8)
    half = e8m0_to_fp32_half(e).astype(np.float64)
    vals = MXFP4_KVALUES[:8].astype(np.float64)  # codes 0..7: the magnitudes
    mag = np.abs(b) / np.where(half > 0, half, 1.0)[..., None]
    code = np.abs(mag[..., None] - vals).argmin(axis=-1).astype(np.uint8)
    code |= np.where((b < 0) & (code > 0), 8, 0).astype(np.uint8)
    out = np.empty((*b.shape[:-1], 17), dtype=np.uint8)
    out[..., 0] = e
    out[..., 1:] = code[..., :16] | (code[..., 16:] << 4)
    return out.reshape(*w.shape[:-1], -1)


def quantize_q8_0(w: np.ndarray) -> np.ndarray:
    """float `[..., N, K]` -> GGML Q8_0 block rows `[..., N, K/32*34]` (ggml's reference rounding)."""
    w = np.asarray(w, dtype=np.float32)
    if w.shape[-1] % TILE:
        raise ValueError(f"K={w.shape[-1]} is not a multiple of {TILE}")
    return np.asarray(gguf_quants.quantize(w, GGMLQuantizationType.Q8_0), dtype=np.uint8)
