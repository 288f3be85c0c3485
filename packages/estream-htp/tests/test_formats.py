from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from estream_htp import testing as T


@given(n=st.integers(1, 70), kb=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_q4_pack_unpack_roundtrip_is_bit_exact(n: int, kb: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    blocks = T.random_q4_0_blocks(rng, n, 32 * kb)
    buf = T.pack_q4_0_t32r4(blocks)
    assert buf.size == T.matrix_nbytes("q4_0-t32r4", n, 32 * kb)
    assert np.array_equal(T.unpack_q4_0_t32r4(buf, n, 32 * kb), blocks)
    # padding rows: scale 0, nibbles 0x88
    pad = T.unpack_q4_0_t32r4(buf, -(-n // 32) * 32, 32 * kb)[n:]
    assert np.all(pad[..., :2] == 0) and np.all(pad[..., 2:] == 0x88)


@given(n=st.integers(1, 70), kb=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_q8_pack_unpack_roundtrip_is_bit_exact(n: int, kb: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    blocks = T.quantize_q8_0(rng.standard_normal((n, 32 * kb)).astype(np.float32))
    buf = T.pack_q8_0_t32r4(blocks)
    assert buf.size == T.matrix_nbytes("q8_0-t32r4", n, 32 * kb)
    assert np.array_equal(T.unpack_q8_0_t32r4(buf, n, 32 * kb), blocks)


def test_tile_byte_positions_follow_the_contract() -> None:
    # one tile: row r, element j -> group (j%16)//4, byte 4g + j%4, low nibble for j < 16
    rng = np.random.default_rng(1)
    blocks = T.random_q4_0_blocks(rng, 32, 32)
    tile = T.pack_q4_0_t32r4(blocks)
    assert tile.size == 576
    for r in (0, 5, 31):
        assert bytes(tile[2 * r : 2 * r + 2]) == bytes(blocks[r, 0, :2])
        for g in range(4):
            assert bytes(tile[64 + 128 * g + 4 * r : 64 + 128 * g + 4 * r + 4]) == bytes(
                blocks[r, 0, 2 + 4 * g : 6 + 4 * g]
            )


def test_quantizers_are_close_to_the_source() -> None:
    rng = np.random.default_rng(2)
    w = rng.standard_normal((40, 128)).astype(np.float32)
    assert T.rel_l2(T.dequantize_q4_0(T.quantize_q4_0(w)), w) < 0.15
    assert T.rel_l2(T.dequantize_q8_0(T.quantize_q8_0(w)), w) < 0.01
    # float input packs through the quantizer
    assert np.array_equal(T.pack_q4_0_t32r4(w), T.pack_q4_0_t32r4(T.quantize_q4_0(w)))


def test_bad_shapes_raise() -> None:
    with pytest.raises(ValueError, match="K % 32"):
        T.pack_q4_0_t32r4(np.zeros((4, 33), np.float32))
    with pytest.raises(ValueError, match="needs"):
        T.unpack_q4_0_t32r4(np.zeros(10, np.uint8), 32, 32)


@given(n=st.integers(1, 70), kb=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_mxfp4_pack_unpack_roundtrip_and_values(n: int, kb: int, seed: int) -> None:
    """MXFP4 blocks of any bytes re-laid as mxfp4-t32r4 and back are the same bytes (padding
    rows all zero); exponent bytes sit at row r, code bytes where q4_0-t32r4 puts nibble bytes;
    the values are the E2M1 value of each code (low nibble: elements 0..15, high: 16..31) times
    2^(e - 127), computed here in float64 from the OCP table."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, kb, 17), dtype=np.uint8)
    blocks[..., 0] = rng.integers(0, 253, size=(n, kb))
    buf = T.pack_mxfp4_t32r4(blocks)
    assert buf.size == T.matrix_nbytes("mxfp4-t32r4", n, 32 * kb) == -(-n // 32) * kb * 544
    assert np.array_equal(T.unpack_mxfp4_t32r4(buf, n, 32 * kb), blocks)
    tiles = buf.reshape(-1, kb, 544)
    r = min(n - 1, 31)
    assert tiles[0, kb - 1, r] == blocks[r, kb - 1, 0]
    for g in range(4):
        assert bytes(tiles[0, 0, 32 + 128 * g + 4 * r : 36 + 128 * g + 4 * r]) == bytes(
            blocks[r, 0, 1 + 4 * g : 5 + 4 * g]
        )
    pad = T.unpack_mxfp4_t32r4(buf, -(-n // 32) * 32, 32 * kb)[n:]
    assert not pad.any()
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    codes = np.concatenate([blocks[..., 1:] & 15, blocks[..., 1:] >> 4], axis=2)
    want = e2m1[codes] * np.exp2(blocks[..., :1].astype(np.float64) - 127)
    got = T.dequantize_tiles(buf, "mxfp4-t32r4", n, 32 * kb)
    assert np.array_equal(got.astype(np.float64), want.reshape(n, -1))


def test_mxfp4_quantizer_is_close_and_packs_floats() -> None:
    """The MXFP4 quantizer stays within half the widest step of each block (2^(e-127)) and a
    float matrix packs through it."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((40, 128)).astype(np.float32)
    b = T.quantize_mxfp4(w)
    step = np.exp2(b[..., 0].astype(np.float64) - 127).repeat(32, axis=1)
    assert np.all(np.abs(T.dequantize_mxfp4(b) - w) <= step)
    assert T.rel_l2(T.dequantize_mxfp4(b), w) < 0.15
    assert np.array_equal(T.pack_mxfp4_t32r4(w), T.pack_mxfp4_t32r4(b))


@given(n=st.integers(1, 70), sb=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_iq4_xs_pack_unpack_roundtrip_and_values(n: int, sb: int, seed: int) -> None:
    """IQ4_XS blocks of any bytes (finite d) re-laid as iq4_xs-t32r4 and back are the same bytes;
    a tile row read by its documented layout (fp16 d at 2r, int8 ls - 32 at 64 + r, codes at
    96 + 128g + 4r + b) gives gguf-py's dequantized values bit for bit, and so does the tiles'
    dequantizer; padding rows have d = 0 and codes 0 (their sub-block scale byte is 0: ls = 32)."""
    from gguf import GGMLQuantizationType
    from gguf import quants as gq

    rng = np.random.default_rng(seed)
    k = 256 * sb
    blocks = T.random_iq4_xs_blocks(rng, n, k)
    buf = T.pack_iq4_xs_t32r4(blocks)
    assert buf.size == T.matrix_nbytes("iq4_xs-t32r4", n, k) == -(-n // 32) * (k // 32) * 608
    assert np.array_equal(T.unpack_iq4_xs_t32r4(buf, n, k), blocks)
    want = gq.dequantize(blocks.reshape(n, -1), GGMLQuantizationType.IQ4_XS).astype(np.float32)
    got = T.dequantize_tiles(buf, "iq4_xs-t32r4", n, k)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    kv = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])
    tiles = buf.reshape(-(-n // 32), k // 32, 608)
    r = n - 1 - 32 * ((n - 1) // 32)  # the last real row, in the last row tile
    for j in range(k // 32):
        t = tiles[-1, j]
        d = np.float32(t[2 * r : 2 * r + 2].view(np.float16)[0])
        s = d * np.float32(t[64 + r].astype(np.int8))
        codes = np.concatenate([t[96 + 128 * g + 4 * r : 100 + 128 * g + 4 * r] for g in range(4)])
        vals = kv[np.concatenate([codes & 15, codes >> 4])].astype(np.float32) * s
        assert np.array_equal(
            vals.view(np.uint32), want[n - 1, 32 * j : 32 * j + 32].view(np.uint32)
        )
    pad = T.unpack_iq4_xs_t32r4(buf, -(-n // 32) * 32, k)[n:]
    assert not pad[..., :2].any() and not pad[..., 8:].any()  # d = 0, codes 0
