from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from hypothesis import given
from hypothesis import strategies as st

from estream_layout import dequantize_tiles, pack_tiles, tile_nbytes, unpack_tiles
from estream_layout.testing import block_matrices, q4_0_blocks
from estream_layout.tiles import (
    dequantize_blocks,
    pad_rows,
    quantize_mxfp4,
    quantize_q4_0,
    quantize_q8_0,
)

FMTS = {"q4_0-t32r4": (18, 4, 576, 0x88), "q8_0-t32r4": (34, 8, 1088, 0x00)}
IQ4_XS = GGMLQuantizationType.IQ4_XS


def reference_pack(blocks: np.ndarray, fmt: str) -> bytes:
    """Tile by tile, straight from the text of docs/contracts.md §1 (independent of tiles.py)."""
    bs, n_groups, tile_bytes, pad_byte = FMTS[fmt]
    n, row_bytes = blocks.shape
    kb = row_bytes // bs
    out = bytearray()
    for i in range(-(-n // 32)):
        for j in range(kb):
            scales = bytearray()
            groups = [bytearray() for _ in range(n_groups)]
            for r in range(32):
                row = 32 * i + r
                if row < n:
                    block = bytes(blocks[row, j * bs : (j + 1) * bs])
                else:
                    block = b"\0\0" + bytes([pad_byte]) * (bs - 2)
                scales += block[:2]
                for g in range(n_groups):
                    groups[g] += block[2 + 4 * g : 2 + 4 * g + 4]
            tile = scales + b"".join(groups)
            assert len(tile) == tile_bytes
            out += tile
    return bytes(out)


@pytest.mark.parametrize("fmt", list(FMTS))
@given(data=st.data())
def test_roundtrip_is_lossless(fmt: str, data: st.DataObject) -> None:
    w = data.draw(block_matrices(fmt))
    n, k = w.shape[0], w.shape[1] // FMTS[fmt][0] * 32
    t = pack_tiles(w, fmt)
    assert t.dtype == np.uint8 and t.shape == (tile_nbytes(n, k, fmt),)
    back = unpack_tiles(t, n, k, fmt)
    assert back.shape == w.shape
    assert np.array_equal(back, w)


@pytest.mark.parametrize("fmt", list(FMTS))
@given(data=st.data())
def test_pack_matches_reference_layout(fmt: str, data: st.DataObject) -> None:
    w = data.draw(block_matrices(fmt, max_rows=70, max_blocks=3))
    assert pack_tiles(w, fmt).tobytes() == reference_pack(w, fmt)


@given(w=q4_0_blocks(max_batch=4, max_rows=70, max_blocks=3))
def test_batched_pack_equals_per_matrix(w: np.ndarray) -> None:
    b, n, rb = w.shape
    k = rb // 18 * 32
    t = pack_tiles(w)
    assert t.shape == (b, tile_nbytes(n, k))
    for e in range(b):
        assert np.array_equal(t[e], pack_tiles(w[e]))
    assert np.array_equal(unpack_tiles(t, n, k), w)


def test_golden_q4_0_tile_bytes() -> None:
    """A hand-built 33x64 matrix: every byte has a known place (a wrong order fails)."""
    n, kb = 33, 2
    blocks = np.zeros((n, kb, 18), dtype=np.uint8)
    for r in range(n):
        for j in range(kb):
            blocks[r, j, 0] = r  # scale low byte = row
            blocks[r, j, 1] = 0x40 + j  # scale high byte = column block
            blocks[r, j, 2:] = [(16 * b + r + j) & 0xFF for b in range(16)]
    t = pack_tiles(blocks.reshape(n, kb * 18))
    assert t.size == 2 * 2 * 576
    # tile (0, 0): scales row order
    assert t[0:6].tolist() == [0, 0x40, 1, 0x40, 2, 0x40]
    # group 0 of tile (0,0): row 0 bytes 0..3, then row 1 bytes 0..3
    assert t[64:72].tolist() == [0, 16, 32, 48, 1, 17, 33, 49]
    # group 1 of tile (0,0) starts at 64+128: row 0 bytes 4..7
    assert t[192:196].tolist() == [64, 80, 96, 112]
    # group 3, row 31 of tile (0,0): bytes 12..15 of row 31 -> last 4 bytes of the tile
    assert t[572:576].tolist() == [(16 * b + 31) & 0xFF for b in range(12, 16)]
    # tile (0, 1) (reduction-tile minor): scale of row 0, block 1
    assert t[576:578].tolist() == [0, 0x41]
    # tile (1, 0): row 32 real, rows 33..63 padding (scale 0, nibbles 0x88)
    base = 2 * 576
    assert t[base : base + 4].tolist() == [32, 0x40, 0, 0]
    assert t[base + 64 : base + 68].tolist() == [32, 48, 64, 80]
    assert t[base + 68 : base + 72].tolist() == [0x88] * 4


def test_golden_q8_0_tile_bytes() -> None:
    n, kb = 32, 1
    blocks = np.zeros((n, kb, 34), dtype=np.uint8)
    for r in range(n):
        blocks[r, 0, :2] = [r, 0x3C]
        blocks[r, 0, 2:] = [(r * 32 + b) & 0xFF for b in range(32)]
    t = pack_tiles(blocks.reshape(n, 34), "q8_0-t32r4")
    assert t.size == 1088
    assert t[62:64].tolist() == [31, 0x3C]
    # group 7 (bytes 28..31) of row 2 at 64 + 7*128 + 2*4
    assert t[64 + 7 * 128 + 8 : 64 + 7 * 128 + 12].tolist() == [
        (64 + b) & 0xFF for b in range(28, 32)
    ]


def test_padding_rows_q8() -> None:
    blocks = np.full((1, 34), 7, dtype=np.uint8)
    t = pack_tiles(blocks, "q8_0-t32r4")
    assert t[2:64].tolist() == [0] * 62  # scales of padding rows 1..31
    assert t[64 + 4 : 64 + 128].tolist() == [0] * 124


@pytest.mark.parametrize(
    ("fmt", "qtype"),
    [("q4_0-t32r4", GGMLQuantizationType.Q4_0), ("q8_0-t32r4", GGMLQuantizationType.Q8_0)],
)
@given(data=st.data())
def test_dequantize_tiles_matches_gguf(
    fmt: str, qtype: GGMLQuantizationType, data: st.DataObject
) -> None:
    w = data.draw(block_matrices(fmt, finite=True))
    n, k = w.shape[0], w.shape[1] // FMTS[fmt][0] * 32
    ref = np.asarray(gguf_quants.dequantize(w, qtype), dtype=np.float64)
    got = dequantize_tiles(pack_tiles(w, fmt), n, k, fmt)
    assert got.shape == (n, k)
    np.testing.assert_array_equal(got.astype(np.float64), ref)


@given(data=st.data())
def test_quantize_roundtrip_error_bound(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 40))
    kb = data.draw(st.integers(1, 4))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    w = rng.standard_normal((n, kb * 32)).astype(np.float32)
    q4 = quantize_q4_0(w)
    q8 = quantize_q8_0(w)
    err4 = np.abs(dequantize_blocks(q4).astype(np.float64) - w)
    err8 = np.abs(dequantize_blocks(q8, "q8_0-t32r4").astype(np.float64) - w)
    amax = np.abs(w.reshape(n, kb, 32)).max(axis=-1, keepdims=True)
    # Q4_0: step d = amax/8; the value opposite the block maximum clamps from 8 to 7 steps, so
    # the error is <= d. Q8_0: round to nearest, error <= d/2 with d = amax/127. Both scales are
    # stored as fp16 (relative error 2^-11, times at most 8 / 127 steps): 1% / 0.07 d of slack.
    assert (err4.reshape(n, kb, 32) <= amax / 8 * 1.01 + 1e-6).all()
    assert (err8.reshape(n, kb, 32) <= amax / 127 * 0.57 + 1e-6).all()
    np.testing.assert_array_equal(unpack_tiles(pack_tiles(q4), n, kb * 32), q4)


def test_tile_nbytes_and_errors() -> None:
    assert tile_nbytes(1, 32) == 576
    assert tile_nbytes(33, 64) == 2 * 2 * 576
    assert tile_nbytes(50277, 2048, "q8_0-t32r4") == 1572 * 64 * 1088
    with pytest.raises(ValueError, match="multiple of 32"):
        tile_nbytes(32, 48)
    with pytest.raises(ValueError, match="unknown tile format"):
        tile_nbytes(32, 32, "q3_k-t32r4")
    with pytest.raises(ValueError, match="whole number"):
        pack_tiles(np.zeros((4, 19), np.uint8))
    with pytest.raises(TypeError):
        pack_tiles(np.zeros((4, 18), np.float32))


def test_pad_rows_keeps_data() -> None:
    rows = np.arange(3 * 36, dtype=np.uint8).reshape(3, 36)
    padded = pad_rows(rows)
    assert padded.shape == (32, 36)
    assert np.array_equal(padded[:3], rows)
    blocks = padded[3:].reshape(29, 2, 18)
    assert (blocks[..., :2] == 0).all() and (blocks[..., 2:] == 0x88).all()


# ------------------------------------------------------------------ K-quant tiles
def _kq_blocks(rng: np.random.Generator, qtype: GGMLQuantizationType, n: int, k: int) -> np.ndarray:
    """Random valid K-quant rows `[n, k/256*block_bytes]` (finite fp16 scales, any bits)."""
    sizes = {GGMLQuantizationType.Q4_K: 144, GGMLQuantizationType.Q5_K: 176, IQ4_XS: 136}
    bb = sizes.get(qtype, 210)
    b = rng.integers(0, 256, size=(n, k // 256, bb), dtype=np.uint8)
    d = (rng.standard_normal((n, k // 256, 2)) * 1e-2).astype(np.float16).view(np.uint8)
    if qtype == IQ4_XS:  # d only: scales_h, scales_l and the codes are any bits
        b[..., 0:2] = d[..., :2]
    elif qtype != GGMLQuantizationType.Q6_K:
        b[..., 0:4] = d.reshape(n, k // 256, 4)
    else:
        b[..., 208:210] = d[..., :2]
    return b.reshape(n, -1)


KQ = [
    ("q4_k-t32r4", GGMLQuantizationType.Q4_K),
    ("q5_k-t32r4", GGMLQuantizationType.Q5_K),
    ("q6_k-t32r4", GGMLQuantizationType.Q6_K),
    ("iq4_xs-t32r4", IQ4_XS),
]


@pytest.mark.parametrize(("fmt", "qtype"), KQ)
@given(n=st.integers(1, 70), sb=st.integers(1, 3), batch=st.integers(0, 2), seed=st.integers(0, 99))
def test_kquant_tiles_roundtrip_and_dequantize_like_gguf(fmt, qtype, n, sb, batch, seed) -> None:
    """K-quant super-blocks re-laid as tiles (any N, padding rows, 1..3 super-blocks, batches):
    unpacking gives the source bytes back, and the tiles' values are gguf-py's dequantization
    of the source tensor bit for bit."""
    rng = np.random.default_rng(seed)
    k = 256 * sb
    shape = (batch, n) if batch else (n,)
    rows = (
        np.stack([_kq_blocks(rng, qtype, n, k) for _ in range(batch)])
        if batch
        else _kq_blocks(rng, qtype, n, k)
    )
    buf = pack_tiles(rows, fmt)
    assert buf.shape == (*shape[:-1], tile_nbytes(n, k, fmt))
    assert np.array_equal(unpack_tiles(buf.reshape(-1), n, k, fmt).reshape(rows.shape), rows)
    for i in range(max(batch, 1)):
        one = buf[i] if batch else buf
        src = rows[i] if batch else rows
        want = np.asarray(gguf_quants.dequantize(src, qtype), dtype=np.float32)
        got = dequantize_tiles(one, n, k, fmt)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_golden_q4_k_tile_bytes() -> None:
    """One Q4_K super-block row with known fields: the tile of sub-block j holds d, dmin, the
    unpacked 6-bit scale and min of j, and the sub-block's nibbles in Q4_0 order."""
    blk = np.zeros(144, np.uint8)
    blk[0:2] = np.array([1.5], np.float16).view(np.uint8)
    blk[2:4] = np.array([0.25], np.float16).view(np.uint8)
    sc = np.array([1, 2, 3, 4, 33, 44, 55, 63], np.uint8)
    mn = np.array([5, 6, 7, 8, 17, 18, 19, 62], np.uint8)
    blk[4:8] = sc[:4] | ((sc[4:] >> 4) << 6)
    blk[8:12] = mn[:4] | ((mn[4:] >> 4) << 6)
    blk[12:16] = (sc[4:] & 15) | ((mn[4:] & 15) << 4)
    vals = np.arange(256) % 16  # element e of the super-block: e mod 16
    for p in range(4):  # qs[32p + l]: element 64p + l low, 64p + 32 + l high
        blk[16 + 32 * p : 48 + 32 * p] = vals[64 * p : 64 * p + 32] | (
            vals[64 * p + 32 : 64 * p + 64] << 4
        )
    buf = pack_tiles(blk.reshape(1, -1), "q4_k-t32r4")
    assert buf.size == 8 * 704
    for j in range(8):
        t = buf[704 * j : 704 * (j + 1)]
        assert t[0:2].view(np.float16)[0] == 1.5 and t[64:66].view(np.float16)[0] == 0.25
        assert t[2] == 0 and t[66] == 0  # row 1: padding, scales 0
        assert (t[128], t[160]) == (sc[j], mn[j]) and t[129] == 0
        # row 0, byte i (group i // 4, lane 0): element i low, element i + 16 high
        for i in range(16):
            assert t[192 + 128 * (i // 4) + i % 4] == (i % 16) | (((i + 16) % 16) << 4)
    assert np.array_equal(unpack_tiles(buf, 1, 256, "q4_k-t32r4")[0], blk)


def test_golden_q6_k_tile_bytes() -> None:
    """One Q6_K super-block row: the tile of sub-block j holds d, scales 2j and 2j+1, and the
    values q - 32 as int8 (column c of row 0 at 128 + 128 (c // 4) + c % 4)."""
    q = (np.arange(256) * 7) % 64  # the 6-bit value of element e
    blk = np.zeros(210, np.uint8)
    for h in range(2):
        for j in range(4):
            e = h * 128 + j * 32 + np.arange(32)
            lo = blk[h * 64 + (j % 2) * 32 : h * 64 + (j % 2) * 32 + 32]
            lo |= ((q[e] & 15) << (4 * (j // 2))).astype(np.uint8)
            blk[128 + h * 32 : 160 + h * 32] |= ((q[e] >> 4) << (2 * j)).astype(np.uint8)
    blk[192:208] = np.arange(16, dtype=np.int8).view(np.uint8) - 8
    blk[208:210] = np.array([0.5], np.float16).view(np.uint8)
    buf = pack_tiles(blk.reshape(1, -1), "q6_k-t32r4")
    assert buf.size == 8 * 1152
    for j in range(8):
        t = buf[1152 * j : 1152 * (j + 1)]
        assert t[0:2].view(np.float16)[0] == 0.5
        assert list(t[64:66].view(np.int8)) == [2 * j - 8, 2 * j - 7]
        for c in range(32):
            assert int(t[128 + 128 * (c // 4) + c % 4].view(np.int8)) == q[32 * j + c] - 32
    assert np.array_equal(unpack_tiles(buf, 1, 256, "q6_k-t32r4")[0], blk)


def test_kquant_needs_whole_super_blocks() -> None:
    """A K-quant matrix's K must be a multiple of 256 (whole super-blocks)."""
    with pytest.raises(ValueError, match="multiple of 256"):
        tile_nbytes(32, 128, "q4_k-t32r4")
    with pytest.raises(ValueError, match="multiple of 256"):
        unpack_tiles(np.zeros(704 * 4, np.uint8), 32, 128, "q6_k-t32r4")


# ------------------------------------------------------------------ MXFP4 tiles
@given(n=st.integers(1, 70), kb=st.integers(1, 5), batch=st.integers(0, 2), seed=st.integers(0, 99))
def test_mxfp4_tiles_roundtrip_and_dequantize_like_gguf(n, kb, batch, seed) -> None:
    """MXFP4 blocks of any bytes (every exponent 0..255, every code; any N with padding rows,
    batches) re-laid as tiles: unpacking gives the source bytes back, and the tiles' values are
    gguf-py's dequantization of the source tensor (llama.cpp's rule) bit for bit."""
    rng = np.random.default_rng(seed)
    k = 32 * kb
    shape = (batch, n, kb * 17) if batch else (n, kb * 17)
    rows = rng.integers(0, 256, size=shape, dtype=np.uint8)
    buf = pack_tiles(rows, "mxfp4-t32r4")
    assert buf.shape == (*shape[:-2], tile_nbytes(n, k, "mxfp4-t32r4"))
    assert tile_nbytes(n, k, "mxfp4-t32r4") == -(-n // 32) * kb * 544
    assert np.array_equal(unpack_tiles(buf.reshape(-1), n, k, "mxfp4-t32r4").reshape(shape), rows)
    for i in range(max(batch, 1)):
        one, src = (buf[i], rows[i]) if batch else (buf, rows)
        with np.errstate(over="ignore"):  # exponents >= 253 overflow float32 (both sides)
            want = gguf_quants.dequantize(src, GGMLQuantizationType.MXFP4).astype(np.float32)
        got = dequantize_tiles(one, n, k, "mxfp4-t32r4")
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_golden_mxfp4_tile_bytes() -> None:
    """One MXFP4 row of two blocks: tile j holds the block's exponent byte at 0 (padding rows
    0), then the 16 code bytes in Q4_0's group order (byte i of row 0 at 32 + 128 (i // 4) +
    i % 4, padding rows' bytes 0)."""
    blk = np.zeros(34, np.uint8)
    blk[0], blk[17] = 130, 7
    blk[1:17] = np.arange(16, dtype=np.uint8) * 17  # byte i: code i in both nibbles
    blk[18:34] = 255 - np.arange(16, dtype=np.uint8)
    buf = pack_tiles(blk.reshape(1, -1), "mxfp4-t32r4")
    assert buf.size == 2 * 544
    for j, e in enumerate((130, 7)):
        t = buf[544 * j : 544 * (j + 1)]
        assert t[0] == e and not t[1:32].any()
        for i in range(16):
            assert t[32 + 128 * (i // 4) + i % 4] == blk[17 * j + 1 + i]
            assert not t[32 + 128 * (i // 4) + 4 : 32 + 128 * (i // 4) + 128].any()
    assert np.array_equal(unpack_tiles(buf, 1, 64, "mxfp4-t32r4")[0], blk)
    w = dequantize_tiles(buf, 1, 64, "mxfp4-t32r4")[0]
    # block 0: scale 2^(130-127) = 8, element i and i + 16 hold code i, E2M1 value kv[i] / 2
    kv = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert w[:16].tolist() == [8 * v for v in kv] and w[16:32].tolist() == w[:16].tolist()


@given(n=st.integers(1, 9), kb=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_quantize_mxfp4_covers_block_and_rounds_to_nearest(n, kb, seed) -> None:
    """The MXFP4 quantizer's exponent is the smallest whose largest value (6 x 2^(e-127))
    covers the block's largest magnitude, and every element goes to the nearest of the 15
    values that exponent offers (blocks of zeros give zeros)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, 32 * kb)) * rng.uniform(1e-4, 1e3, (n, 1))).astype(np.float32)
    w[0, :32] = 0.0
    b = quantize_mxfp4(w).reshape(n, kb, 17)
    got = dequantize_blocks(b.reshape(n, -1), "mxfp4-t32r4").astype(np.float64)
    scale = np.exp2(b[..., 0].astype(np.float64) - 127)  # [n, kb]
    blocks = w.reshape(n, kb, 32).astype(np.float64)
    amax = np.abs(blocks).max(axis=-1)
    assert np.all(amax <= 6 * scale)
    nonzero = amax > 0
    assert np.all(amax[nonzero] > 3 * scale[nonzero])  # one exponent less would not cover it
    assert not got[0, :32].any()
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    cand = np.concatenate([grid, -grid])[None, None, None, :] * scale[..., None, None]
    best = np.abs(blocks[..., None] - cand).min(axis=-1)
    assert np.array_equal(np.abs(blocks - got.reshape(n, kb, 32)), best)


@given(n=st.integers(1, 40), sb=st.integers(1, 2), seed=st.integers(0, 99))
def test_q5_k_tile_values_follow_the_documented_layout(n, sb, seed) -> None:
    """A q5_k-t32r4 tile read by its documented layout alone (docs/format.md: fp16 d at 2r,
    dmin at 64 + 2r, sc at 128 + r, m at 160 + r, Q4_0-order nibbles from 192, row r's fifth
    bits as a little-endian uint32 at 704 + 4r) gives gguf-py's Q5_K values bit for bit."""
    rng = np.random.default_rng(seed)
    rows = _kq_blocks(rng, GGMLQuantizationType.Q5_K, n, 256 * sb)
    want = gguf_quants.dequantize(rows, GGMLQuantizationType.Q5_K).astype(np.float32)
    t = pack_tiles(rows, "q5_k-t32r4").reshape(-1, 8 * sb, 832)  # [row tile, column tile]
    got = np.empty((t.shape[0] * 32, 256 * sb), np.float32)
    for j in range(8 * sb):
        tile = t[:, j]
        d = tile[:, 0:64].copy().view(np.float16).astype(np.float32)
        dmin = tile[:, 64:128].copy().view(np.float16).astype(np.float32)
        sc, mn = tile[:, 128:160].astype(np.float32), tile[:, 160:192].astype(np.float32)
        nib = tile[:, 192:704].reshape(-1, 4, 32, 4).transpose(0, 2, 1, 3).reshape(-1, 32, 16)
        words = tile[:, 704:832].copy().view("<u4")  # [tiles, 32 rows]
        high = (words[..., None] >> np.arange(32, dtype=np.uint32)) & 1
        q = np.concatenate([nib & 15, nib >> 4], axis=-1) | (high << 4).astype(np.uint8)
        v = (d * sc)[..., None] * q.astype(np.float32) - (dmin * mn)[..., None]
        got[:, 32 * j : 32 * j + 32] = v.reshape(-1, 32)
    assert np.array_equal(got[:n].view(np.uint32), want.view(np.uint32))


@given(n=st.integers(1, 40), sb=st.integers(1, 2), seed=st.integers(0, 99))
def test_iq4_xs_tile_values_follow_the_documented_layout(n, sb, seed) -> None:
    """An iq4_xs-t32r4 tile read by its documented layout alone (docs/format.md: fp16 d at 2r,
    int8 ls - 32 at 64 + r, Q4_0-order codes from 96 indexing kvalues_iq4nl) gives gguf-py's
    IQ4_XS values bit for bit; padding rows read as 0."""
    rng = np.random.default_rng(seed)
    rows = _kq_blocks(rng, IQ4_XS, n, 256 * sb)
    want = gguf_quants.dequantize(rows, IQ4_XS).astype(np.float32)
    t = pack_tiles(rows, "iq4_xs-t32r4").reshape(-1, 8 * sb, 608)  # [row tile, column tile]
    kv = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])
    got = np.empty((t.shape[0] * 32, 256 * sb), np.float32)
    for j in range(8 * sb):
        tile = t[:, j]
        d = tile[:, 0:64].copy().view(np.float16).astype(np.float32)
        sc = tile[:, 64:96].view(np.int8).astype(np.float32)
        codes = tile[:, 96:608].reshape(-1, 4, 32, 4).transpose(0, 2, 1, 3).reshape(-1, 32, 16)
        q = kv[np.concatenate([codes & 15, codes >> 4], axis=-1)].astype(np.float32)
        got[:, 32 * j : 32 * j + 32] = ((d * sc)[..., None] * q).reshape(-1, 32)
    assert np.array_equal(got[:n].view(np.uint32), want.view(np.uint32))
    assert not got[n:].any()


@given(n=st.integers(1, 70), kb=st.integers(1, 5), batch=st.integers(0, 2), seed=st.integers(0, 99))
def test_iq4_nl_tiles_roundtrip_and_dequantize_like_gguf(n, kb, batch, seed) -> None:
    """IQ4_NL blocks (finite fp16 scales, any codes; any N with padding rows, batches) re-laid
    as iq4_nl-t32r4 (q4_0-t32r4's byte layout): unpacking gives the source bytes back, the
    tiles are the bytes q4_0-t32r4 makes of the same blocks, and their values are gguf-py's
    dequantization (d x kvalues_iq4nl[code]) bit for bit."""
    rng = np.random.default_rng(seed)
    shape = (batch, n, kb * 18) if batch else (n, kb * 18)
    rows = rng.integers(0, 256, size=shape, dtype=np.uint8)
    d = (rng.standard_normal((*shape[:-1], kb)) * 1e-2).astype(np.float16).view(np.uint8)
    rows.reshape(*shape[:-1], kb, 18)[..., :2] = d.reshape(*shape[:-1], kb, 2)
    buf = pack_tiles(rows, "iq4_nl-t32r4")
    assert np.array_equal(buf, pack_tiles(rows, "q4_0-t32r4"))
    k = 32 * kb
    assert np.array_equal(unpack_tiles(buf.reshape(-1), n, k, "iq4_nl-t32r4").reshape(shape), rows)
    for i in range(max(batch, 1)):
        one, src = (buf[i], rows[i]) if batch else (buf, rows)
        want = gguf_quants.dequantize(src, GGMLQuantizationType.IQ4_NL).astype(np.float32)
        got = dequantize_tiles(one, n, k, "iq4_nl-t32r4")
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


AFFINE = [
    ("q4_1-t32r4", GGMLQuantizationType.Q4_1, 20),
    ("q5_0-t32r4", GGMLQuantizationType.Q5_0, 22),
    ("q5_1-t32r4", GGMLQuantizationType.Q5_1, 24),
]


@pytest.mark.parametrize(("fmt", "qtype", "bs"), AFFINE)
@given(n=st.integers(1, 70), kb=st.integers(1, 4), batch=st.integers(0, 2), seed=st.integers(0, 99))
def test_q4_1_q5_tiles_roundtrip_and_read_by_their_layout(
    fmt, qtype, bs, n, kb, batch, seed
) -> None:
    """Q4_1 / Q5_0 / Q5_1 blocks (finite fp16 d and m, any bits; any N, batches) re-laid as
    tiles: unpacking gives the source bytes back, and a tile read by its documented layout
    alone (docs/format.md: d (and m) per row, the row's fifth bits as a little-endian word,
    Q4_0-order nibbles) gives gguf-py's dequantization bit for bit."""
    rng = np.random.default_rng(seed)
    shape = (batch, n, kb * bs) if batch else (n, kb * bs)
    rows = rng.integers(0, 256, size=shape, dtype=np.uint8)
    b = rows.reshape(*shape[:-1], kb, bs)
    hdr = 2 if qtype == GGMLQuantizationType.Q5_0 else 4
    b[..., :hdr] = (
        (rng.standard_normal((*shape[:-1], kb, hdr // 2)) * 1e-2).astype(np.float16).view(np.uint8)
    )
    buf = pack_tiles(rows, fmt)
    k = 32 * kb
    assert np.array_equal(unpack_tiles(buf.reshape(-1), n, k, fmt).reshape(shape), rows)
    one, src = (buf[0], rows[0]) if batch else (buf, rows)
    want = gguf_quants.dequantize(src, qtype).astype(np.float32)
    tb = {20: 640, 22: 704, 24: 768}[bs]
    t = one.reshape(-1, kb, tb)  # [row tile, column tile, bytes]
    h = 32 * hdr
    d = t[..., :h].reshape(-1, kb, 32, hdr // 2, 2).copy().view(np.float16)[..., 0]
    d = d.astype(np.float32)  # [tiles, kb, 32 rows, (d, m)]
    g0 = h + (128 if qtype != GGMLQuantizationType.Q4_1 else 0)
    nib = t[..., g0 : g0 + 512].reshape(-1, kb, 4, 32, 4).transpose(0, 1, 3, 2, 4)
    nib = nib.reshape(-1, kb, 32, 16)
    q = np.concatenate([nib & 15, nib >> 4], axis=-1).astype(np.int32)
    if qtype != GGMLQuantizationType.Q4_1:
        words = t[..., h : h + 128].copy().view("<u4")  # [tiles, kb, 32 rows]
        q |= (((words[..., None] >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.int32)
    if qtype == GGMLQuantizationType.Q5_0:
        v = d[..., 0, None] * (q - 16).astype(np.float32)
    else:
        v = d[..., 0, None] * q.astype(np.float32) + d[..., 1, None]
    got = v.transpose(0, 2, 1, 3).reshape(-1, k)[:n]
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(dequantize_tiles(one, n, k, fmt).view(np.uint32), want.view(np.uint32))


FLOAT16 = [("f16-t32r4", GGMLQuantizationType.F16), ("bf16-t32r4", GGMLQuantizationType.BF16)]


@pytest.mark.parametrize(("fmt", "qtype"), FLOAT16)
@given(n=st.integers(1, 70), kb=st.integers(1, 4), batch=st.integers(0, 2), seed=st.integers(0, 99))
def test_float16_tiles_roundtrip_and_dequantize_like_gguf(fmt, qtype, n, kb, batch, seed) -> None:
    """F16 / BF16 rows (any 16-bit patterns: subnormals, infinities, NaNs; any N with padding
    rows, batches) re-laid as f16-t32r4 / bf16-t32r4: unpacking gives the source bytes back and
    the tiles' values are gguf-py's dequantization of the source bit for bit."""
    rng = np.random.default_rng(seed)
    shape = (batch, n, 32 * kb) if batch else (n, 32 * kb)
    rows = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16).view(np.uint8)
    buf = pack_tiles(rows, fmt)
    assert buf.shape == (*shape[:-2], tile_nbytes(n, 32 * kb, fmt))
    assert tile_nbytes(n, 32 * kb, fmt) == -(-n // 32) * kb * 2048
    assert np.array_equal(unpack_tiles(buf.reshape(-1), n, 32 * kb, fmt).reshape(rows.shape), rows)
    for i in range(max(batch, 1)):
        src = rows[i] if batch else rows
        want = np.asarray(gguf_quants.dequantize(src, qtype), dtype=np.float32)
        got = dequantize_tiles(buf[i] if batch else buf, n, 32 * kb, fmt)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("fmt", ["f16-t32r4", "bf16-t32r4"])
@given(n=st.integers(1, 40), kb=st.integers(1, 3), seed=st.integers(0, 99))
def test_float16_tile_bytes_follow_the_documented_layout(fmt, n, kb, seed) -> None:
    """A 2048-byte f16-t32r4 / bf16-t32r4 tile read by its documented layout alone
    (docs/format.md: no header; the 16-bit value of row r, column c at byte 128 * (c // 2) +
    4 * r + 2 * (c % 2)) holds the source matrix's 16-bit values; padding rows are 0."""
    rng = np.random.default_rng(seed)
    u = rng.integers(0, 1 << 16, size=(n, 32 * kb), dtype=np.uint16)
    t = pack_tiles(u.view(np.uint8), fmt).reshape(-1, kb, 2048)  # [row tile, column tile]
    got = np.empty((t.shape[0] * 32, 32 * kb), np.uint16)
    for i in range(t.shape[0]):
        for j in range(kb):
            tile = t[i, j]
            for r in range(32):
                for c in range(32):
                    o = 128 * (c // 2) + 4 * r + 2 * (c % 2)
                    got[32 * i + r, 32 * j + c] = int(tile[o]) | int(tile[o + 1]) << 8
    assert np.array_equal(got[:n], u)
    assert not got[n:].any()
