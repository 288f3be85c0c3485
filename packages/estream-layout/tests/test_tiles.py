from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from hypothesis import given
from hypothesis import strategies as st

from estream_layout import dequantize_tiles, pack_tiles, tile_nbytes, unpack_tiles
from estream_layout.testing import block_matrices, q4_0_blocks
from estream_layout.tiles import dequantize_blocks, pad_rows, quantize_q4_0, quantize_q8_0

FMTS = {"q4_0-t32r4": (18, 4, 576, 0x88), "q8_0-t32r4": (34, 8, 1088, 0x00)}


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
        tile_nbytes(32, 32, "q5_0-t32r4")
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
