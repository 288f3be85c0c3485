from __future__ import annotations

import numpy as np
import pytest
from helpers import LEVELS, SIMD_PARAMS, kquant_stress_case, mode
from hypothesis import given
from hypothesis import strategies as st

import estream_htp as htp
from estream_htp import testing as T

# Tolerances (relative L2 vs float64 on the dequantized weights; the reference norm is floored at
# the fp32 rounding scale ‖|X||W|ᵀ‖/√K so that outputs that cancel to ~0 stay testable):
F32_TOL = 1e-5  # fp32 activations: only fp32 rounding of products/sums
Q8_EXACT_TOL = 1e-5  # int8 path vs a reference fed the same int8-rounded activations

shapes = st.tuples(
    st.integers(1, 23), st.integers(1, 97), st.integers(1, 6), st.integers(0, 2**32 - 1)
)


def _case(t: int, n: int, kb: int, seed: int, fmt: str):
    rng = np.random.default_rng(seed)
    k = 32 * kb
    w = rng.standard_normal((n, k)).astype(np.float32)
    buf = T.pack_q4_0_t32r4(w) if fmt == "q4_0-t32r4" else T.pack_q8_0_t32r4(w)
    x = (rng.standard_normal((t, k)) * rng.uniform(0.1, 10)).astype(np.float32)
    return x, buf


@pytest.mark.parametrize("simd", SIMD_PARAMS)
@pytest.mark.parametrize("fmt", ["q4_0-t32r4", "q8_0-t32r4"])
@given(shape=shapes)
def test_gemm_f32_matches_float64(simd: str, fmt: str, shape) -> None:
    t, n, kb, seed = shape
    x, buf = _case(t, n, kb, seed, fmt)
    out = np.full((t, n), np.nan, dtype=np.float32)
    with mode(simd=simd, act="f32"):
        y = htp.gemm(x, buf, n, fmt, out=out)
    assert y is out
    mag = T.ref_gemm_magnitude(x, buf, n, fmt)
    assert T.rel_l2_floored(y, T.ref_gemm(x, buf, n, fmt), mag, x.shape[1]) <= F32_TOL


@pytest.mark.parametrize("simd", SIMD_PARAMS)
@pytest.mark.parametrize("fmt", ["q4_0-t32r4", "q8_0-t32r4"])
@given(shape=shapes)
def test_gemm_q8_matches_float64(simd: str, fmt: str, shape) -> None:
    t, n, kb, seed = shape
    x, buf = _case(t, n, kb, seed, fmt)
    out = np.full((t, n), np.nan, dtype=np.float32)
    with mode(simd=simd, act="q8"):
        y = htp.gemm(x, buf, n, fmt, out=out)
    xq = T.ref_q8_activations(x)
    mag = T.ref_gemm_magnitude(xq, buf, n, fmt)
    assert T.rel_l2_floored(y, T.ref_gemm(xq, buf, n, fmt), mag, x.shape[1]) <= Q8_EXACT_TOL
    # and the int8 rounding itself stays within its worst case: |x - q·d| <= d/2 per element
    d_half = np.repeat(np.abs(x).reshape(t, -1, 32).max(axis=2) / 127.0 / 2.0, 32, axis=1)
    bound = (
        np.abs(d_half) @ np.abs(T.dequantize_tiles(buf, fmt, n, x.shape[1]).astype(np.float64)).T
    )
    err = np.abs(y - T.ref_gemm(x, buf, n, fmt))
    assert np.all(err <= bound * 1.001 + 1e-5 * mag)


KQ_FORMATS = ["q4_k-t32r4", "q5_k-t32r4", "q6_k-t32r4", "iq4_xs-t32r4"]  # 256-value blocks
XS = "iq4_xs-t32r4"
kq_shapes = st.tuples(
    st.integers(1, 19), st.integers(1, 77), st.integers(1, 3), st.integers(0, 2**32 - 1)
)


def _kq_case(t: int, n: int, sb: int, seed: int, fmt: str):
    """Random valid K-quant blocks for W[n][256*sb] packed into fmt, and activations."""
    rng = np.random.default_rng(seed)
    k = 256 * sb
    if fmt == "q4_k-t32r4":
        buf = T.pack_q4_k_t32r4(T.random_q4_k_blocks(rng, n, k))
    elif fmt == "q5_k-t32r4":
        buf = T.pack_q5_k_t32r4(T.random_q5_k_blocks(rng, n, k))
    elif fmt == XS:
        buf = T.pack_iq4_xs_t32r4(T.random_iq4_xs_blocks(rng, n, k))
    else:
        buf = T.pack_q6_k_t32r4(T.random_q6_k_blocks(rng, n, k))
    x = (rng.standard_normal((t, k)) * rng.uniform(0.1, 10)).astype(np.float32)
    return x, buf


@pytest.mark.parametrize("simd", SIMD_PARAMS)
@pytest.mark.parametrize("fmt", KQ_FORMATS)
@given(shape=kq_shapes)
def test_gemm_kquant_f32_matches_float64(simd: str, fmt: str, shape) -> None:
    """K-quant tiles with fp32 activations, awkward N (padding rows) and K of 1..3 super-blocks,
    into a NaN-poisoned output: the float64 product of the dequantized tiles, to fp32 rounding."""
    t, n, sb, seed = shape
    x, buf = _kq_case(t, n, sb, seed, fmt)
    out = np.full((t, n), np.nan, dtype=np.float32)
    with mode(simd=simd, act="f32"):
        y = htp.gemm(x, buf, n, fmt, out=out)
    assert y is out
    mag = T.ref_gemm_magnitude(x, buf, n, fmt)
    assert T.rel_l2_floored(y, T.ref_gemm(x, buf, n, fmt), mag, x.shape[1]) <= F32_TOL


@pytest.mark.parametrize("simd", SIMD_PARAMS)
@pytest.mark.parametrize("fmt", KQ_FORMATS)
@given(shape=kq_shapes)
def test_gemm_kquant_q8_matches_float64(simd: str, fmt: str, shape) -> None:
    """K-quant tiles with int8 activations (per 32-block): the float64 product of the
    dequantized tiles with the same int8-rounded activations, to fp32 rounding; 1 and 2
    threads give the same bits."""
    t, n, sb, seed = shape
    x, buf = _kq_case(t, n, sb, seed, fmt)
    ys = []
    for th in (1, 2):
        out = np.full((t, n), np.nan, dtype=np.float32)
        with mode(simd=simd, act="q8", threads=th):
            ys.append(htp.gemm(x, buf, n, fmt, out=out))
    assert np.array_equal(ys[0], ys[1])
    xq = T.ref_q8_activations(x)
    mag = T.ref_gemm_magnitude(xq, buf, n, fmt)
    assert T.rel_l2_floored(ys[0], T.ref_gemm(xq, buf, n, fmt), mag, x.shape[1]) <= Q8_EXACT_TOL


@pytest.mark.parametrize("fmt", ["q4_k-t32r4", "q5_k-t32r4", "q6_k-t32r4"])
@pytest.mark.parametrize(
    ("t", "n", "sb", "seed"), [(1, 1, 1, 1), (7, 33, 1, 2), (29, 70, 2, 3), (65, 97, 3, 4)]
)
def test_gemm_kquant_tables_give_portable_bits(
    fmt: str, t: int, n: int, sb: int, seed: int
) -> None:
    """Q4_K, Q5_K and Q6_K tiles x int8 activations: every kernel table this CPU runs gives the
    portable table's results bit for bit (exact integer block sums and one shared fp32
    epilogue), at token counts off the kernels' 4 / 6 / 64 token steps, row counts off 16 / 32,
    1..3 super-blocks, and scales that stress the rounding (_kq_stress_case); from rows the
    GEMM quantizes itself (with the Q6_K start values and Q4_K / Q5_K sa·da the kernels read)
    and from rows quantized beforehand (quantize_q8: the kernels compute those themselves)."""
    _, buf, x = kquant_stress_case(t, n, sb, seed, fmt)
    with mode(simd="portable", act="q8", threads=1):
        base = htp.gemm(x, buf, n, fmt)
    assert np.isfinite(base).all() and np.abs(base).max() > 0
    for simd in LEVELS:
        for th in (1, 2):
            with mode(simd=simd, act="q8", threads=th):
                y = htp.gemm(x, buf, n, fmt)
                y_rows = htp.gemm(htp.quantize_q8(x), buf, n, fmt)
            assert np.array_equal(y.view(np.uint32), base.view(np.uint32)), (simd, th)
            assert np.array_equal(y_rows.view(np.uint32), base.view(np.uint32)), (simd, th)


@pytest.mark.parametrize("fmt", ["q4_k-t32r4", "q5_k-t32r4"])
@pytest.mark.parametrize(
    ("t", "n", "sb", "seed"), [(7, 33, 9, 5), (13, 5, 17, 6), (64, 32, 4, 7), (20, 50, 18, 8)]
)
def test_gemm_k45_chunked_strips_give_portable_bits(
    fmt: str, t: int, n: int, sb: int, seed: int
) -> None:
    """Q5_K with more than one token block a strip call (the AVX-512 kernels then prepare the
    tiles' operands and scales once a chunk of 32 tiles, carrying the accumulators across chunks
    through the output), and Q4_K on the same shapes: the portable table's bits on every table,
    at 32, 72, 136 and 144 tiles a strip (one whole chunk, chunk boundaries, a short last
    chunk), token counts off the 6-token block, rows < 32, into an output filled with NaN."""
    _, buf, x = kquant_stress_case(t, n, sb, seed, fmt)
    with mode(simd="portable", act="q8", threads=1):
        base = htp.gemm(x, buf, n, fmt)
    assert np.isfinite(base).all() and np.abs(base).max() > 0
    for simd in LEVELS:
        with mode(simd=simd, act="q8", threads=2):
            for rows in (x, htp.quantize_q8(x)):
                out = np.full((t, n), np.nan, np.float32)
                htp.gemm(rows, buf, n, fmt, out=out)
                assert np.array_equal(out.view(np.uint32), base.view(np.uint32)), simd


@pytest.mark.parametrize("fmt", KQ_FORMATS)
def test_gemm_kquant_stress_matches_float64(fmt: str) -> None:
    """The stress inputs of the bit test (scales over four decades, near-cancelling mins,
    activations over six decades) stay within fp32 rounding of the float64 product of the
    dequantized tiles and the same int8-rounded activations, on every table."""
    if fmt == XS:
        x, buf = _kq_case(29, 70, 2, 3, fmt)
    else:
        _, buf, x = kquant_stress_case(29, 70, 2, 3, fmt)
    xq = T.ref_q8_activations(x)
    mag = T.ref_gemm_magnitude(xq, buf, 70, fmt)
    ref = T.ref_gemm(xq, buf, 70, fmt)
    for simd in LEVELS:
        with mode(simd=simd, act="q8"):
            y = htp.gemm(x, buf, 70, fmt)
        assert T.rel_l2_floored(y, ref, mag, x.shape[1]) <= Q8_EXACT_TOL, simd


def test_gemm_iq4_xs_tables_give_portable_bits() -> None:
    """Every kernel table this CPU runs gives the portable table's IQ4_XS x Q8 results bit for
    bit (exact integer block sums, the portable epilogue: (float)(sc x dot) x (d x da), then the
    sum), codes of every value, sub-block scales -32 and 31 and activations of +-127 included."""
    rng = np.random.default_rng(17)
    blocks = T.random_iq4_xs_blocks(rng, 70, 768)
    blocks[:2, :, 2:8] = np.array([[0, 0, 0, 0, 0, 0], [0xFF] * 6], np.uint8)[:, None, :]
    buf = T.pack_iq4_xs_t32r4(blocks)
    x = np.random.default_rng(18).standard_normal((29, 768)).astype(np.float32)
    x[:3, ::2] = 50.0
    with mode(simd="portable", act="q8", threads=1):
        base = htp.gemm(x, buf, 70, XS)
    assert np.isfinite(base).all()
    assert np.abs(base[:, :2]).max() > 0  # the extreme-scale rows are not all zero
    for simd in LEVELS:
        with mode(simd=simd, act="q8"):
            y = htp.gemm(x, buf, 70, XS)
        assert np.array_equal(y.view(np.uint32), base.view(np.uint32)), simd


MX, NL = "mxfp4-t32r4", "iq4_nl-t32r4"  # 4-bit codes looked up in a table of values
AFF = ["q4_1-t32r4", "q5_0-t32r4", "q5_1-t32r4"]  # d*q + m / d*(q - 16), q of 4 or 5 bits


def _mx_case(t: int, n: int, kb: int, seed: int, fmt: str = MX):
    """Random valid MXFP4 (or IQ4_NL, Q4_1, Q5_0, Q5_1) blocks for W[n][32*kb] packed as fmt,
    and activations."""
    rng = np.random.default_rng(seed)
    k = 32 * kb
    if fmt == MX:
        buf = T.pack_mxfp4_t32r4(T.random_mxfp4_blocks(rng, n, k))
    elif fmt in AFF:
        buf = T.pack_q4_1_q5_t32r4(T.random_q4_1_q5_blocks(rng, n, k, fmt), fmt)
    else:
        buf = T.pack_iq4_nl_t32r4(T.random_iq4_nl_blocks(rng, n, k))
    x = (rng.standard_normal((t, k)) * rng.uniform(0.1, 10)).astype(np.float32)
    return x, buf


@pytest.mark.parametrize("simd", SIMD_PARAMS)
@pytest.mark.parametrize("fmt", [MX, NL, *AFF])
@given(shape=shapes)
def test_gemm_mxfp4_and_iq4_nl_f32_matches_float64(simd: str, fmt: str, shape) -> None:
    """MXFP4 tiles (any codes, subnormal scales included), IQ4_NL, Q4_1, Q5_0 and Q5_1 tiles
    with fp32 activations, awkward N (padding rows) and K of 1..6 blocks, into a NaN-poisoned
    output: the float64 product of the dequantized tiles, to fp32 rounding."""
    t, n, kb, seed = shape
    x, buf = _mx_case(t, n, kb, seed, fmt)
    out = np.full((t, n), np.nan, dtype=np.float32)
    with mode(simd=simd, act="f32"):
        y = htp.gemm(x, buf, n, fmt, out=out)
    assert y is out
    mag = T.ref_gemm_magnitude(x, buf, n, fmt)
    assert T.rel_l2_floored(y, T.ref_gemm(x, buf, n, fmt), mag, x.shape[1]) <= F32_TOL


@pytest.mark.parametrize("simd", SIMD_PARAMS)
@pytest.mark.parametrize("fmt", [MX, NL, *AFF])
@given(shape=shapes)
def test_gemm_mxfp4_and_iq4_nl_q8_matches_float64(simd: str, fmt: str, shape) -> None:
    """MXFP4, IQ4_NL, Q4_1, Q5_0 and Q5_1 tiles with int8 activations (per 32-block): the
    float64 product of the dequantized tiles with the same int8-rounded activations, to fp32
    rounding; 1 and 2 threads give the same bits."""
    t, n, kb, seed = shape
    x, buf = _mx_case(t, n, kb, seed, fmt)
    ys = []
    for th in (1, 2):
        out = np.full((t, n), np.nan, dtype=np.float32)
        with mode(simd=simd, act="q8", threads=th):
            ys.append(htp.gemm(x, buf, n, fmt, out=out))
    assert np.array_equal(ys[0], ys[1])
    xq = T.ref_q8_activations(x)
    mag = T.ref_gemm_magnitude(xq, buf, n, fmt)
    assert T.rel_l2_floored(ys[0], T.ref_gemm(xq, buf, n, fmt), mag, x.shape[1]) <= Q8_EXACT_TOL


@pytest.mark.parametrize("fmt", [NL, *AFF])
def test_gemm_iq4_nl_tables_give_portable_bits(fmt: str) -> None:
    """Every kernel table this CPU runs gives the portable table's IQ4_NL (Q4_1, Q5_0, Q5_1) x
    Q8 results bit for bit (exact integer block sums, the portable epilogue: products, then
    sums), codes of every value and activations of +-127 included."""
    x, buf = _mx_case(29, 70, 7, 11, fmt)
    x[:3, ::2] = 50.0
    with mode(simd="portable", act="q8", threads=1):
        base = htp.gemm(x, buf, 70, fmt)
    assert np.isfinite(base).all()
    for simd in LEVELS:
        with mode(simd=simd, act="q8"):
            y = htp.gemm(x, buf, 70, fmt)
        assert np.array_equal(y.view(np.uint32), base.view(np.uint32)), simd


def _lq_stress_case(t: int, n: int, nb: int, seed: int, fmt: str):
    """IQ4_NL / IQ4_XS / Q4_1 / Q5_0 / Q5_1 tiles for W[n][k] (k = 32 x nb; IQ4_XS 256 x nb)
    and activations[t][k], to stress the integer sums and the fp32 epilogue: fp16 d (and m)
    with full significands over six decades and both signs, row 0 all-zero codes (IQ4: -127,
    IQ4_XS scale -32; Q5: fifth bits 0) and row 1 all-ones (IQ4: 113, scale 31; Q5: q = 31),
    and activation blocks of +-127 (every other value at the block's maximum) in tokens 0..2."""
    rng = np.random.default_rng(seed)
    k = (256 if fmt == XS else 32) * nb
    if fmt == XS:
        b = T.random_iq4_xs_blocks(rng, n, k)
    elif fmt == NL:
        b = T.random_iq4_nl_blocks(rng, n, k)
    else:
        b = T.random_q4_1_q5_blocks(rng, n, k, fmt)
    head = 4 if fmt in ("q4_1-t32r4", "q5_1-t32r4") else 2  # the fp16 scale(s) of a block
    b[0, :, head:] = 0
    b[1 % n, :, head:] = 0xFF
    for off in range(0, head, 2):
        shape = b.shape[:2]
        v = rng.uniform(0.5, 1.0, shape) * np.exp2(rng.integers(-20, 0, shape))
        v *= rng.choice([-1.0, 1.0], shape)
        b[..., off : off + 2] = v.astype(np.float16)[..., None].view(np.uint8)
    if fmt == XS:
        buf = T.pack_iq4_xs_t32r4(b)
    elif fmt == NL:
        buf = T.pack_iq4_nl_t32r4(b)
    else:
        buf = T.pack_q4_1_q5_t32r4(b, fmt)
    x = (rng.standard_normal((t, k)) * 10.0 ** rng.uniform(-3, 3, (t, 1))).astype(np.float32)
    x[:3, ::2] = 50.0
    x[1 % t] *= -1
    return x, buf


@pytest.mark.parametrize("fmt", [NL, XS, *AFF])
@pytest.mark.parametrize(
    ("t", "n", "nb", "seed"),
    [(1, 1, 1, 1), (5, 17, 3, 2), (7, 31, 1, 3), (13, 33, 5, 4), (67, 70, 3, 5)],
)
def test_gemm_lq_tables_give_portable_bits_on_awkward_shapes(
    fmt: str, t: int, n: int, nb: int, seed: int
) -> None:
    """IQ4_NL, IQ4_XS, Q4_1, Q5_0 and Q5_1 tiles x int8 activations: every kernel table this CPU
    runs writes the portable table's results bit for bit into a NaN-poisoned output, at token
    counts off the kernels' 4 / 6 / 64 token steps (67 crosses a 64-token strip), row counts
    below and off 16 / 32, odd block counts, and the stress inputs of _lq_stress_case; from rows
    the GEMM quantizes itself and from rows quantized beforehand; and the portable result is the
    float64 product of the dequantized tiles with the same int8-rounded activations, to fp32
    rounding."""
    x, buf = _lq_stress_case(t, n, nb, seed, fmt)
    with mode(simd="portable", act="q8", threads=1):
        base = htp.gemm(x, buf, n, fmt)
    assert np.isfinite(base).all() and np.abs(base).max() > 0
    xq = T.ref_q8_activations(x)
    mag = T.ref_gemm_magnitude(xq, buf, n, fmt)
    ref = T.ref_gemm(xq, buf, n, fmt)
    assert T.rel_l2_floored(base, ref, mag, x.shape[1]) <= Q8_EXACT_TOL
    for simd in LEVELS:
        for th in (1, 2):
            with mode(simd=simd, act="q8", threads=th):
                y = htp.gemm(x, buf, n, fmt, out=np.full((t, n), np.nan, np.float32))
                y_rows = htp.gemm(
                    htp.quantize_q8(x), buf, n, fmt, out=np.full((t, n), np.nan, np.float32)
                )
            assert np.array_equal(y.view(np.uint32), base.view(np.uint32)), (simd, th)
            assert np.array_equal(y_rows.view(np.uint32), base.view(np.uint32)), (simd, th)


def test_gemm_mxfp4_tables_give_portable_bits() -> None:
    """Every kernel table this CPU runs gives the portable table's MXFP4 x Q8 results bit for
    bit: the integer block sums are exact and every kernel keeps the portable epilogue (the
    product (float)dot x (scale x da), then the sum, no fused multiply-add). Codes of every
    value (the table lookups) and activations near +-127 (the widest pair sums) included."""
    rng = np.random.default_rng(5)
    blocks = T.random_mxfp4_blocks(rng, 70, 224)
    blocks[:4, :, 1:] = np.array([0x77, 0xFF, 0x7F, 0xF7], np.uint8)[:, None, None]  # +-6
    buf = T.pack_mxfp4_t32r4(blocks)
    x = rng.standard_normal((29, 224)).astype(np.float32)
    x[:3, ::2] = 50.0  # blocks of +-amax: every activation +-127 after quantization
    x[1] *= -1
    with mode(simd="portable", act="q8", threads=1):
        base = htp.gemm(x, buf, 70, MX)
    assert np.isfinite(base).all()
    for simd in LEVELS:
        with mode(simd=simd, act="q8"):
            y = htp.gemm(x, buf, 70, MX)
        assert np.array_equal(y.view(np.uint32), base.view(np.uint32)), simd


def test_random_mxfp4_blocks_subnormal_share() -> None:
    """`random_mxfp4_blocks`' ``subnormal`` share of blocks takes the subnormal scales (exponent
    0 or 1), the others 2^-12..2^-1: none for timings, all when asked, some by default."""
    rng = np.random.default_rng(2)
    e = {s: T.random_mxfp4_blocks(rng, 64, 512, subnormal=s)[..., 0] for s in (0.0, 0.05, 1.0)}
    assert e[0.0].min() >= 115 and e[0.0].max() <= 126
    assert e[1.0].max() <= 1
    share = float((e[0.05] <= 1).mean())
    assert 0.02 < share < 0.08, share
    assert (T.random_mxfp4_blocks(rng, 64, 512)[..., 0] <= 1).any()


@pytest.mark.parametrize("act", ["f32", "q8"])
def test_gemm_paths_and_thread_counts_agree(act: str) -> None:
    x, buf = _case(37, 133, 8, 7, "q4_0-t32r4")
    with mode(simd="portable", act=act, threads=1):
        base = htp.gemm(x, buf, 133)
    for simd in LEVELS:
        ys = []
        for th in (1, 2):
            with mode(simd=simd, act=act, threads=th):
                ys.append(htp.gemm(x, buf, 133))
        assert np.array_equal(ys[0], ys[1]), simd  # partitioned outputs: bit-identical
        assert T.rel_l2(ys[0], base) <= 1e-6, simd


@pytest.mark.parametrize("simd", SIMD_PARAMS)
@pytest.mark.parametrize("threads", [1, 2])
def test_gemm_q8_token_chunks(simd: str, threads: int) -> None:
    """Long prompts are cut into token chunks (~384 KiB of int8 rows: 72 tokens at k = 4096).
    Awkward t spans several chunks and a ragged last one; every row must give the bits it
    gives alone, and match float64, in both matrices of a shared-input GEMM."""
    x, buf = _case(203, 75, 128, 11, "q4_0-t32r4")
    _, buf2 = _case(1, 40, 128, 12, "q4_0-t32r4")
    xq = T.ref_q8_activations(x)
    with mode(simd=simd, act="q8", threads=threads):
        y = htp.gemm(x, buf, 75, out=np.full((203, 75), np.nan, np.float32))
        ya, yb = htp.gemm_shared(x, [(buf, 75), (buf2, 40)])
        alone = np.concatenate(
            [htp.gemm(x[i : i + 1], buf, 75) for i in (0, 71, 72, 143, 144, 202)]
        )
    assert y.tobytes() == ya.tobytes()
    assert alone.tobytes() == y[[0, 71, 72, 143, 144, 202]].tobytes()
    for out, b, n in ((y, buf, 75), (yb, buf2, 40)):
        mag = T.ref_gemm_magnitude(xq, b, n, "q4_0-t32r4")
        assert T.rel_l2_floored(out, T.ref_gemm(xq, b, n, "q4_0-t32r4"), mag, 4096) <= Q8_EXACT_TOL


def test_gemm_rejects_bad_inputs() -> None:
    x, buf = _case(4, 40, 2, 0, "q4_0-t32r4")
    with pytest.raises(htp.HTPInputError, match="dtype float32"):
        htp.gemm(x.astype(np.float64), buf, 40)
    with pytest.raises(htp.HTPInputError, match="needs"):
        htp.gemm(x, buf[:-1], 40)
    with pytest.raises(htp.HTPInputError, match="multiple of 32"):
        htp.gemm(np.zeros((4, 48), np.float32), buf, 40)
    with pytest.raises(htp.HTPInputError, match="shape"):
        htp.gemm(x, buf, 40, out=np.empty((4, 41), np.float32))
    with pytest.raises(htp.HTPInputError, match="C-contiguous"):
        htp.gemm(np.asfortranarray(np.zeros((4, 64), np.float32)), buf, 40)
    with pytest.raises(htp.HTPInputError, match="fmt"):
        htp.gemm(x, buf, 40, fmt="q4_k")


@pytest.mark.parametrize("simd", SIMD_PARAMS)
@pytest.mark.parametrize("act", ["f32", "q8"])
@given(
    t=st.integers(1, 23),
    ns=st.lists(st.integers(1, 97), min_size=1, max_size=3),
    kb=st.integers(1, 6),
    fmt=st.sampled_from(["q4_0-t32r4", "q8_0-t32r4"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_gemm_shared_is_each_gemm_alone(simd, act, t, ns, kb, fmt, seed) -> None:
    """Up to three matrices sharing one input in one op: every output is bit-identical to the
    one-matrix GEMM of its matrix (one quantization of X serves all) and, with int8 products,
    to the op reading X quantized beforehand (`quantize_q8`); right against float64; the
    partition over threads spans all matrices' tiles as one range."""
    rng = np.random.default_rng(seed)
    k = 32 * kb
    x = (rng.standard_normal((t, k)) * rng.uniform(0.1, 10)).astype(np.float32)
    pack = T.pack_q4_0_t32r4 if fmt == "q4_0-t32r4" else T.pack_q8_0_t32r4
    mats = [(pack(rng.standard_normal((n, k)).astype(np.float32)), n) for n in ns]
    outs = [np.full((t, n), np.nan, dtype=np.float32) for n in ns]
    for threads in (1, 2):
        with mode(simd=simd, act=act, threads=threads):
            ys = htp.gemm_shared(x, mats, fmt, [o.copy() for o in outs])
            alone = [htp.gemm(x, w, n, fmt, out=o.copy()) for (w, n), o in zip(mats, outs)]
            if act == "q8":  # from the input quantized once beforehand: the same bits
                rows = htp.quantize_q8(x)
                from_rows = htp.gemm_shared(rows, mats, fmt, [o.copy() for o in outs])
                for y, r in zip(ys, from_rows, strict=True):
                    assert np.array_equal(y, r)
                assert np.array_equal(htp.gemm(rows, *mats[0], fmt), ys[0])
        for y, a in zip(ys, alone, strict=True):
            assert np.array_equal(y, a)
    xr = x if act == "f32" else T.ref_q8_activations(x)
    for (w, n), y in zip(mats, ys, strict=True):
        mag = T.ref_gemm_magnitude(xr, w, n, fmt)
        assert T.rel_l2_floored(y, T.ref_gemm(xr, w, n, fmt), mag, k) <= F32_TOL


def test_gemm_shared_rejects_bad_inputs() -> None:
    x, buf = _case(4, 40, 2, 0, "q4_0-t32r4")
    with pytest.raises(htp.HTPInputError, match="1 to 3 matrices, got 4"):
        htp.gemm_shared(x, [(buf, 40)] * 4)
    with pytest.raises(htp.HTPInputError, match="1 to 3 matrices, got 0"):
        htp.gemm_shared(x, [])
    with pytest.raises(htp.HTPInputError, match=r"w\[1\] holds .* needs"):
        htp.gemm_shared(x, [(buf, 40), (buf[:-1], 40)])
    with pytest.raises(htp.HTPInputError, match="2 matrices but 1 outputs"):
        htp.gemm_shared(x, [(buf, 40), (buf, 40)], outs=[np.empty((4, 40), np.float32)])
    with pytest.raises(htp.HTPInputError, match=r"outs\[1\] must have shape \(4, 8\)"):
        htp.gemm_shared(x, [(buf, 40), (buf, 8)], outs=[np.empty((4, 40), np.float32)] * 2)


def test_gemm_from_q8_rows_rejects_bad_inputs() -> None:
    x, buf = _case(4, 40, 2, 0, "q4_0-t32r4")
    rows = htp.quantize_q8(x)
    with mode(act="f32"), pytest.raises(htp.HTPInputError, match="needs act='q8'"):
        htp.gemm(rows, buf, 40)
    with mode(act="q8"):
        with pytest.raises(htp.HTPInputError, match=r"holds .* needs"):  # K=96 from the rows
            htp.gemm(htp.quantize_q8(np.zeros((4, 96), np.float32)), buf, 40)
        with pytest.raises(htp.HTPInputError, match=r"out must have shape \(4, 40\)"):
            htp.gemm(rows, buf, 40, out=np.empty((3, 40), np.float32))
        # a descriptor claiming fp32 products for Q8 rows is refused by the C validator
        be = htp.default_backend()
        c = be.call(htp._core.lib.HTP_OP_GEMM, "f32")
        p = c.p.gemm
        p.format, p.n, p.k, p.t, p.ldx, p.ldy, p.x_q8 = (
            htp._core._FMT["q4_0-t32r4"],
            40,
            64,
            4,
            64,
            40,
            1,
        )
        c.ref(buf).ref(rows.data).ref(np.empty((4, 40), np.float32), "w")
        with pytest.raises(htp.HTPInputError, match="kernel rejected"):
            be.run(c)


AMX = htp.simd_supported("amx")


@pytest.mark.skipif(not AMX, reason="needs a CPU with AMX-INT8 the OS enables (hardware)")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "t,n,kb",
    [
        (1, 32, 1),  # one token: all on the VNNI kernel (fewer than 32 per call)
        (27, 40, 5),  # 27 tokens: VNNI in calls of 6; a ragged second strip
        (32, 17, 3),  # two tile blocks; rows < 32 (one half), an odd block count (no 2nd set)
        (40, 64, 33),  # 32 on the tile unit + an 8-token VNNI tail; k spans two unpack chunks
        (64, 33, 64),  # the kernel's 64 tokens at once; one row in the last strip
        (65, 96, 70),  # 64 + 1 (two calls per strip); chunks of 32 + 32 + 6 blocks
        (203, 75, 128),  # token chunks of the GEMM driver: calls of 64, 64, 56 (48 + 8), odd rows
    ],
)
def test_amx_q4_bits_equal_vnni(t: int, n: int, kb: int, threads: int) -> None:
    """The AMX Q4_0 x Q8 strip computes each block's integer dot product on the tile unit and
    runs the VNNI kernel's fp32 epilogue (token tails go to the VNNI kernel itself): the outputs
    must be the VNNI kernel's, bit for bit (a wrong tile layout, scale index or tail split
    changes bits, not only the tolerance)."""
    x, buf = _case(t, n, kb, 31 * t + n, "q4_0-t32r4")
    ys = {}
    for simd in ("avx512vnni", "amx"):
        out = np.full((t, n), np.nan, np.float32)
        with mode(simd=simd, act="q8", threads=threads):
            ys[simd] = htp.gemm(x, buf, n, out=out)
    assert ys["amx"].tobytes() == ys["avx512vnni"].tobytes()
    xq = T.ref_q8_activations(x)
    mag = T.ref_gemm_magnitude(xq, buf, n, "q4_0-t32r4")
    ref = T.ref_gemm(xq, buf, n, "q4_0-t32r4")
    assert T.rel_l2_floored(ys["amx"], ref, mag, x.shape[1]) <= Q8_EXACT_TOL


@pytest.mark.parametrize("fmt", ["q8_0-t32r4", "q4_0-t32r4"])
def test_gemm_q8_0_simd_tables_same_bits(fmt: str) -> None:
    """Q8_0 and Q4_0 tiles with int8 activations: every table this CPU runs, the portable
    reference body included, gives the same bits (exact integer block sums, then the same
    fused multiply-add per block in block order, written out in the reference body rather than
    left to the compiler's contraction), so the hand-written kernels reproduce it."""
    levels = [lv for lv in LEVELS if lv != "neon"]
    if len(levels) < 2:
        pytest.skip(f"needs two tables, this CPU runs {LEVELS}")
    rng = np.random.default_rng(31)
    n, k, t = 77, 512, 19
    if fmt == "q8_0-t32r4":
        buf = T.pack_q8_0_t32r4(T.random_q8_0_blocks(rng, n, k))
    else:
        buf = htp.pack_q4_0_t32r4(rng.standard_normal((n, k)).astype(np.float32))
    x = rng.standard_normal((t, k)).astype(np.float32)
    outs = []
    for simd in levels:
        with mode(simd=simd, act="q8"):
            outs.append(htp.gemm(x, buf, n, fmt))
    for simd, y in zip(levels, outs):
        assert np.array_equal(y.view(np.uint32), outs[0].view(np.uint32)), simd
