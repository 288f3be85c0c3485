"""f16-t32r4 / bf16-t32r4 dense matrices: 16-bit float values in tiles, converted exactly to
fp32 and multiplied with fp32 activations under either activation format."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import LEVELS, SIMD_PARAMS, mode
from hypothesis import given
from hypothesis import strategies as st

import estream_htp as htp
from estream_htp import testing as T

FLOAT_FMTS = ["f16-t32r4", "bf16-t32r4"]
F32_TOL = 1e-5  # relative L2 vs float64 of the same values: fp32 rounding of products and sums

shapes = st.tuples(
    st.integers(1, 23), st.integers(1, 97), st.integers(1, 5), st.integers(0, 2**32 - 1)
)


def _exact_values(buf: np.ndarray, fmt: str, n: int, k: int) -> np.ndarray:
    """The tiles' values read by the documented byte layout alone (docs/format.md §1: the
    16-bit value of row r, column c of a tile at 128 * (c // 2) + 4r + 2 * (c % 2)), converted
    by numpy: float16 -> float32, or bfloat16 as the high half of a float32."""
    kb, nt = k // 32, -(-n // 32)
    t = buf.view("<u2").reshape(nt, kb, 16, 32, 2)  # [tile row, tile col, group, row, b]
    u = t.transpose(0, 3, 1, 2, 4).reshape(nt * 32, k)[:n]
    if fmt == "f16-t32r4":
        return u.view(np.float16).astype(np.float32)
    return (u.astype(np.uint32) << np.uint32(16)).view(np.float32)


@pytest.mark.parametrize("fmt", FLOAT_FMTS)
@given(n=st.integers(1, 70), kb=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_float_tiles_pack_and_dequantize_exactly(fmt: str, n: int, kb: int, seed: int) -> None:
    """pack_f16_t32r4 lays 16-bit values as documented (2048 B a tile, padding rows zero) and
    dequantize_tiles gives each value converted to fp32 bit for bit (subnormals, -0.0 and the
    largest finite values included)."""
    rng = np.random.default_rng(seed)
    k = 32 * kb
    buf = T.random_f16_t32r4(rng, n, k, fmt, largest=True)
    assert buf.size == htp.matrix_nbytes(fmt, n, k) == -(-n // 32) * kb * 2048
    want = _exact_values(buf, fmt, n, k)
    got = htp.dequantize_tiles(buf, fmt, n, k)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    pad = _exact_values(buf, fmt, -(-n // 32) * 32, k)[n:]
    assert not pad.view(np.uint32).any()


@pytest.mark.parametrize("simd", SIMD_PARAMS)
@pytest.mark.parametrize("fmt", FLOAT_FMTS)
@given(shape=shapes)
def test_float_tile_gemm_matches_float64(simd: str, fmt: str, shape) -> None:
    """An f16/bf16 GEMM (awkward T, N with padding rows, K of 1..5 blocks) into a NaN-poisoned
    output equals the float64 product of the exact values to fp32 rounding, under either
    activation format: act="q8" multiplies these matrices in fp32 too, with the same bits."""
    t, n, kb, seed = shape
    rng = np.random.default_rng(seed)
    k = 32 * kb
    buf = T.random_f16_t32r4(rng, n, k, fmt)
    x = (rng.standard_normal((t, k)) * rng.uniform(0.1, 10)).astype(np.float32)
    ys = []
    for act in ("f32", "q8"):
        out = np.full((t, n), np.nan, dtype=np.float32)
        with mode(simd=simd, act=act):
            y = htp.gemm(x, buf, n, fmt, out=out)
        assert y is out
        ys.append(y)
    assert np.array_equal(ys[0].view(np.uint32), ys[1].view(np.uint32))
    ref = x.astype(np.float64) @ _exact_values(buf, fmt, n, k).astype(np.float64).T
    mag = T.ref_gemm_magnitude(x, buf, n, fmt)
    assert T.rel_l2_floored(ys[0], ref, mag, k) <= F32_TOL


@pytest.mark.parametrize("fmt", FLOAT_FMTS)
def test_every_table_converts_the_values_exactly(fmt: str) -> None:
    """Multiplied by the identity (one token per column), every kernel table this CPU runs
    returns the matrix's values converted to fp32, bit for bit (-0.0 as +0.0: an fp32 sum
    starts at +0.0), subnormal and largest finite values included; 1 and 2 threads alike."""
    rng = np.random.default_rng(5)
    n, k = 45, 96
    buf = T.random_f16_t32r4(rng, n, k, fmt, largest=True)
    want = _exact_values(buf, fmt, n, k).T + np.float32(0.0)  # [k, n], -0.0 -> +0.0
    eye = np.eye(k, dtype=np.float32)
    for simd in ("portable", *LEVELS):
        for th in (1, 2):
            with mode(simd=simd, act="f32", threads=th):
                y = htp.gemm(eye, buf, n, fmt, out=np.full((k, n), np.nan, np.float32))
            assert np.array_equal(y.view(np.uint32), want.view(np.uint32)), (simd, th)


@pytest.mark.parametrize("fmt", FLOAT_FMTS)
def test_every_table_agrees_and_shared_gemms_equal_single_ones(fmt: str) -> None:
    """The fp32 products of every kernel table this CPU runs agree with the portable table's
    to fp32 rounding (the values are the same bits, see above; a table may fuse the
    multiply-adds of the fp32 strip, as it does for every tile format), and within one table
    gemm_shared of three matrices gives each single gemm's bits, under act="q8" too."""
    rng = np.random.default_rng(9)
    k, ns = 160, (70, 33, 5)
    bufs = [T.random_f16_t32r4(rng, n, k, fmt) for n in ns]
    x = rng.standard_normal((29, k)).astype(np.float32)
    with mode(simd="portable", act="f32", threads=1):
        base = [htp.gemm(x, b, n, fmt) for b, n in zip(bufs, ns, strict=True)]
    for simd in ("portable", *LEVELS):
        with mode(simd=simd, act="q8"):
            ys = htp.gemm_shared(x, list(zip(bufs, ns, strict=True)), fmt)
            singles = [htp.gemm(x, b, n, fmt) for b, n in zip(bufs, ns, strict=True)]
        for y, one, b in zip(ys, singles, base, strict=True):
            assert np.array_equal(y.view(np.uint32), one.view(np.uint32)), simd
            assert T.rel_l2(y, b) <= 1e-6, simd


@pytest.mark.parametrize("fmt", FLOAT_FMTS)
def test_int8_activation_rows_are_refused(fmt: str) -> None:
    """Q8Rows (int8 activations) given for an f16/bf16 matrix are refused with one clear error
    naming the format, before anything runs, and a raw descriptor doing so by the C validator;
    the output is left untouched."""
    rng = np.random.default_rng(1)
    buf = T.random_f16_t32r4(rng, 40, 64, fmt)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    with mode(act="q8"):
        rows = htp.quantize_q8(x)
        out = np.full((3, 40), np.nan, np.float32)
        with pytest.raises(htp.HTPInputError, match=f"{fmt} matrices are multiplied in fp32"):
            htp.gemm(rows, buf, 40, fmt, out=out)
        # a descriptor giving Q8 rows for these tiles is refused by the C validator too
        be = htp.default_backend()
        c = be.call(htp._core.lib.HTP_OP_GEMM, "q8")
        p = c.p.gemm
        p.format, p.n, p.k, p.t, p.ldx, p.ldy = htp._core._FMT[fmt], 40, 64, 3, 64, 40
        p.x_q8 = 1
        c.ref(buf).ref(rows.data).ref(out, "w")
        with pytest.raises(htp.HTPInputError, match="kernel rejected"):
            be.run(c)
    assert np.isnan(out).all()


@pytest.mark.parametrize("fmt", FLOAT_FMTS)
@given(n=st.integers(1, 70), kb=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_get_rows_of_float_tiles_are_the_exact_values(fmt: str, n: int, kb: int, seed: int) -> None:
    """Embedding rows of an f16/bf16 table (any ids, repeats, the last row of a padded tile)
    are the rows' values converted to fp32 bit for bit, into a NaN-poisoned output."""
    rng = np.random.default_rng(seed)
    k = 32 * kb
    buf = T.random_f16_t32r4(rng, n, k, fmt, largest=True)
    ids = rng.integers(0, n, size=7).astype(np.int32)
    ids[0] = n - 1
    out = np.full((7, k), np.nan, np.float32)
    y = htp.get_rows(buf, fmt, n, k, ids, out)
    want = _exact_values(buf, fmt, n, k)[ids]
    assert np.array_equal(y.view(np.uint32), want.view(np.uint32))
