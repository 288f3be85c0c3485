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
