from __future__ import annotations

import numpy as np
import pytest
from helpers import LEVELS, SIMD_PARAMS, mode
from hypothesis import given, settings
from hypothesis import strategies as st

import estream_htp as htp
from estream_htp import testing as T
from estream_htp._ffi import lib

TOL = 1e-5  # fp32 ops vs float64 references


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


@given(
    t=st.integers(1, 9),
    h=st.integers(1, 4),
    dh=st.integers(1, 70),
    seed=st.integers(0, 2**32 - 1),
    with_w=st.booleans(),
)
def test_rms_norm(t: int, h: int, dh: int, seed: int, with_w: bool) -> None:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((t, h * dh)) * 3).astype(np.float32)
    wd = rng.standard_normal(dh).astype(np.float32)
    out = np.full_like(x, np.nan)
    if h == 1:
        y = htp.rms_norm(x, wd if with_w else None, 1e-6, out=out)
    else:
        y = htp.rms_norm_heads(x, wd, h, 1e-6, out=out)
        with_w = True
    assert T.rel_l2(y, T.ref_rms_norm(x, wd if with_w else None, 1e-6, h)) <= TOL
    # in place (out=x) gives the same bytes: each row is read whole before it is written
    xi = x.copy()
    if h == 1:
        zi = htp.rms_norm(xi, wd if with_w else None, 1e-6, out=xi)
    else:
        zi = htp.rms_norm_heads(xi, wd, h, 1e-6, out=xi)
    assert zi is xi and np.array_equal(xi, y)


def _rms_bits(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """The kernel's RMSNorm, bit for bit: each row's squares (exact in double) summed in order
    on 8 lanes (column c on lane c % 8, up to the last full 8) and a tail sum, the lanes added
    ((0+4)+(1+5))+((2+6)+(3+7)), eps as the fp32 the kernel takes, then fp32 x * inv (* w)."""
    t, d = x.shape
    x64 = x.astype(np.float64) ** 2
    full = d - d % 8
    out = np.empty_like(x)
    for i in range(t):
        lane = [np.cumsum(x64[i, j:full:8])[-1] if full else 0.0 for j in range(8)]
        ss = np.cumsum(x64[i, full:])[-1] if d > full else 0.0
        ss += ((lane[0] + lane[4]) + (lane[1] + lane[5])) + (
            (lane[2] + lane[6]) + (lane[3] + lane[7])
        )
        inv = np.float32(1.0 / np.sqrt(ss / d + float(np.float32(eps))))
        out[i] = x[i] * inv if w is None else (x[i] * inv) * w
    return out


@pytest.mark.parametrize("simd", SIMD_PARAMS)
@settings(max_examples=30, deadline=None)
@given(
    t=st.integers(1, 70),
    d=st.integers(1, 300),
    seed=st.integers(0, 2**32 - 1),
    with_w=st.booleans(),
)
def test_rms_norm_bits_on_every_level(simd: str, t: int, d: int, seed: int, with_w: bool) -> None:
    """Every kernel table gives the portable body's bits (the sums' lanes and order written out
    in `_rms_bits`), on widths with and without a tail past the last full 8, whatever the
    threads' split of the rows (t * d above the kernel's threshold for threading)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((t, d)) * rng.choice([1e-3, 1.0, 30.0])).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32) if with_w else None
    want = _rms_bits(x, w, 1e-6)
    big = np.repeat(x, 70000 // (t * d) + 1, axis=0)
    for threads in (1, 2):
        with mode(simd=simd, threads=threads):
            got = htp.rms_norm(x, w, 1e-6, out=np.full_like(x, np.nan))
            got_big = htp.rms_norm(big, w, 1e-6)
        assert _same_bits(got, want)
        assert _same_bits(got_big, np.repeat(want, big.shape[0] // t, axis=0))


@given(
    t=st.integers(1, 9),
    h=st.integers(1, 3),
    half=st.integers(1, 20),
    extra=st.integers(0, 6),
    mode_=st.sampled_from(["normal", "neox"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_rope(t: int, h: int, half: int, extra: int, mode_: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n_rot = 2 * half
    x = rng.standard_normal((t, h, n_rot + extra)).astype(np.float32)
    pos = rng.integers(0, 5000, t).astype(np.int32)
    ref = T.ref_rope(x, pos, n_rot, 10000.0, 0.5, mode_)
    htp.rope(x, pos, n_rot, 10000.0, 0.5, mode_)  # type: ignore[arg-type]
    assert T.rel_l2(x, ref) <= TOL


@given(
    t=st.integers(1, 9),
    h=st.integers(1, 3),
    half=st.integers(1, 40),
    extra=st.integers(0, 7),
    mode_=st.sampled_from(["normal", "neox"]),
    factor=st.sampled_from([1.0, 4.0, 40.0]),
    ext=st.sampled_from([0.0, 1.0, 0.5]),
    attn=st.sampled_from([1.0, 0.7, 1.3]),
    n_ctx_orig=st.sampled_from([32, 4096]),
    seed=st.integers(0, 2**32 - 1),
)
def test_rope_yarn(
    t: int,
    h: int,
    half: int,
    extra: int,
    mode_: str,
    factor: float,
    ext: float,
    attn: float,
    n_ctx_orig: int,
    seed: int,
) -> None:
    """YaRN RoPE against the float64 reference; the dims past n_rot must pass through."""
    rng = np.random.default_rng(seed)
    n_rot = 2 * half
    x = rng.standard_normal((t, h, n_rot + extra)).astype(np.float32)
    pos = rng.integers(0, 20000, t).astype(np.int32)
    corr = htp.rope_yarn_corr_dims(n_rot, n_ctx_orig, 10000.0) if n_rot >= 2 else (0.0, 0.0)
    kw = {"ext_factor": ext, "attn_factor": attn, "corr_dims": corr}
    ref = T.ref_rope(x, pos, n_rot, 10000.0, 1.0 / factor, mode_, **kw)
    htp.rope(x, pos, n_rot, 10000.0, 1.0 / factor, mode_, **kw)  # type: ignore[arg-type]
    assert T.rel_l2(x, ref) <= TOL
    assert np.array_equal(x[..., n_rot:], ref[..., n_rot:].astype(np.float32))


def test_rope_yarn_corr_dims_deepseek_v2_lite() -> None:
    """DeepSeek-V2-Lite: 64 rotated dims, original context 4096, base 1e4 -> pairs 10..23
    (64 ln(4096 / 64π) / 2 ln 1e4 = 10.47, 64 ln(4096 / 2π) / 2 ln 1e4 = 22.5)."""
    assert htp.rope_yarn_corr_dims(64, 4096, 10000.0) == (10.0, 23.0)
    assert htp.rope_yarn_corr_dims(16, 32, 10000.0) == (0.0, 2.0)  # clamped below at 0
    with pytest.raises(htp.HTPInputError, match="YaRN needs"):
        htp.rope_yarn_corr_dims(64, 0, 10000.0)


def test_rope_yarn_ramp_is_applied() -> None:
    """The YaRN terms are not silently ignored: a YaRN rotation differs from a plain one, and
    attn_factor scales the rotated part only."""
    x = np.ones((3, 1, 12), np.float32)
    pos = np.array([0, 7, 300], np.int32)
    plain, yarn = x.copy(), x.copy()
    htp.rope(plain, pos, 8, 1e4, 0.25, "normal")
    htp.rope(yarn, pos, 8, 1e4, 0.25, "normal", ext_factor=1.0, corr_dims=(0.0, 3.0))
    assert not np.allclose(plain, yarn)
    scaled = x.copy()
    htp.rope(scaled, pos, 8, 1e4, 0.25, "normal", attn_factor=0.5)
    assert np.allclose(scaled[..., :8], 0.5 * plain[..., :8]) and np.all(scaled[..., 8:] == 1)
    with pytest.raises(htp.HTPInputError, match="ext_factor must be finite"):
        htp.rope(x.copy(), pos, 8, 1e4, 0.25, "normal", ext_factor=float("nan"))


def _check_attention(
    simd: str, t: int, hkv: int, rep: int, dk: int, dv: int, causal: bool, seed: int
) -> None:
    """fp32 attention at one level against float64, into a NaN-poisoned output, and bit for bit
    the portable body's (every table follows one sequence of fp32 operations)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((t, hkv * rep, dk)).astype(np.float32)
    k = rng.standard_normal((t, hkv, dk)).astype(np.float32)
    v = rng.standard_normal((t, hkv, dv)).astype(np.float32)
    outs = {}
    for level in (simd, "portable"):
        out = np.full((t, hkv * rep, dv), np.nan, np.float32)
        with mode(simd=level):
            outs[level] = htp.attention(q, k, v, 1.0 / np.sqrt(dk), causal, out=out)
    assert T.rel_l2(outs[simd], T.ref_attention(q, k, v, 1.0 / np.sqrt(dk), causal)) <= TOL
    assert _same_bits(outs[simd], outs["portable"])


@pytest.mark.parametrize("simd", SIMD_PARAMS)
@given(
    t=st.integers(1, 100),
    hkv=st.integers(1, 3),
    rep=st.integers(1, 3),
    dk=st.integers(1, 40),
    dv=st.integers(1, 40),
    causal=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_attention(
    simd: str, t: int, hkv: int, rep: int, dk: int, dv: int, causal: bool, seed: int
) -> None:
    _check_attention(simd, t, hkv, rep, dk, dv, causal, seed)


@pytest.mark.parametrize("simd", SIMD_PARAMS)
@settings(max_examples=25, deadline=None)
@given(
    t=st.integers(1, 200),
    hkv=st.integers(1, 2),
    rep=st.integers(1, 3),
    dk=st.sampled_from([16, 32, 48, 64, 128]),
    dv=st.sampled_from([16, 32, 80, 128]),
    causal=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_attention_register_blocks(
    simd: str, t: int, hkv: int, rep: int, dk: int, dv: int, causal: bool, seed: int
) -> None:
    """Head dims that are multiples of 16 take the SIMD levels' register-blocked kernels (K
    re-laid once per call, query rows in blocks of 4 or 6, partial key blocks on the causal
    diagonal, value dims not a multiple of the column block): float64 reference, NaN-poisoned
    output, several query and key blocks."""
    _check_attention(simd, t, hkv, rep, dk, dv, causal, seed)


TOL_BF16 = 1e-2  # bf16 products (rounded q*scale, k, v, softmax weights) vs float64: ~3e-3
TOL_BF16_PV = 5e-3  # bf16 P·V only (rounded v and softmax weights; fp32 scores): ~2e-3


@pytest.mark.parametrize("products", ["bf16", "bf16-pv"])
@pytest.mark.parametrize("simd", SIMD_PARAMS)
@given(
    t=st.integers(1, 150),
    hkv=st.integers(1, 3),
    rep=st.integers(1, 3),
    dk=st.sampled_from([16, 32, 48, 64, 128, 1, 7, 20, 33]),
    dv=st.sampled_from([16, 32, 80, 128, 3, 24, 40]),
    causal=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_attention_bf16(
    products: str, simd: str, t: int, hkv: int, rep: int, dk: int, dv: int, causal: bool, seed: int
) -> None:
    """Both bf16 modes at every level (native vdpbf16ps kernels where the CPU has AVX512_BF16
    and head dims are multiples of 16, else the emulation) against float64, and bit for bit
    the portable emulation of the native kernel; they must really differ from fp32 products
    and from each other."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((t, hkv * rep, dk)).astype(np.float32)
    k = rng.standard_normal((t, hkv, dk)).astype(np.float32)
    v = rng.standard_normal((t, hkv, dv)).astype(np.float32)
    scale = 1.0 / np.sqrt(dk)
    outs = {}
    for level in (simd, "portable"):
        out = np.full((t, hkv * rep, dv), np.nan, np.float32)
        with mode(simd=level):
            outs[level] = htp.attention(q, k, v, scale, causal, out=out, products=products)
    ref = T.ref_attention(q, k, v, scale, causal)
    assert T.rel_l2(outs[simd], ref) <= (TOL_BF16 if products == "bf16" else TOL_BF16_PV)
    assert _same_bits(outs[simd], outs["portable"])
    f32 = htp.attention(q, k, v, scale, causal)
    other = htp.attention(
        q, k, v, scale, causal, products="bf16-pv" if products == "bf16" else "bf16"
    )
    if t > 1:  # (one key: the weight is exactly 1 and only v's rounding shows)
        assert not np.array_equal(outs[simd], f32)
    if t > 16:  # (a few keys: rounding q and k may move no weight's bfloat16)
        assert not np.array_equal(outs[simd], other)


@pytest.mark.parametrize("simd", SIMD_PARAMS)
@settings(max_examples=30, deadline=None)
@given(
    t=st.integers(1, 160),
    ctx=st.integers(0, 90),
    hkv=st.integers(1, 2),
    rep=st.sampled_from([1, 2, 3, 8]),
    dims=st.sampled_from([(192, 128), (64, 64), (128, 128), (48, 80), (20, 24), (7, 33)]),
    window=st.integers(0, 140),
    with_sinks=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_attention_window_and_sinks(
    simd: str,
    t: int,
    ctx: int,
    hkv: int,
    rep: int,
    dims: tuple[int, int],
    window: int,
    with_sinks: bool,
    seed: int,
) -> None:
    """Causal attention with a sliding window (query at position p sees keys p - W < j <= p)
    and per-head sinks (a logit joining the denominator only), over GQA and MLA's 192/128 head
    split, partial query and key blocks and a context, fp32 and bf16 products, against float64
    into NaN-poisoned outputs; both bit for bit the portable body's (bf16: its emulation of the
    native kernel)."""
    dk, dv = dims
    rng = np.random.default_rng(seed)
    hq = hkv * rep
    q = rng.standard_normal((t, hq, dk)).astype(np.float32)
    k = rng.standard_normal((ctx + t, hkv, dk)).astype(np.float32)
    v = rng.standard_normal((ctx + t, hkv, dv)).astype(np.float32)
    sinks = (3 * rng.standard_normal(hq)).astype(np.float32) if with_sinks else None
    scale = 1.0 / np.sqrt(dk)
    ref = T.ref_attention(q, k, v, scale, True, context=ctx, window=window, sinks=sinks)
    outs = {}
    for products, level in (
        ("f32", simd),
        ("bf16", simd),
        ("bf16-pv", simd),
        ("f32", "portable"),
        ("bf16", "portable"),
        ("bf16-pv", "portable"),
    ):
        out = np.full((t, hq, dv), np.nan, np.float32)
        with mode(simd=level):
            outs[products, level] = htp.attention(
                q, k, v, scale, True, out, products=products, context=ctx, window=window,
                sinks=sinks,
            )  # fmt: skip
    assert T.rel_l2(outs["f32", simd], ref) <= TOL
    assert T.rel_l2(outs["bf16", simd], ref) <= TOL_BF16
    assert T.rel_l2(outs["bf16-pv", simd], ref) <= TOL_BF16_PV
    assert _same_bits(outs["f32", simd], outs["f32", "portable"])
    assert _same_bits(outs["bf16", simd], outs["bf16", "portable"])
    assert _same_bits(outs["bf16-pv", simd], outs["bf16-pv", "portable"])


def test_round_bf16() -> None:
    """Nearest even on the 8-bit mantissa, subnormals to signed zero, and the result is the
    bf16 a one-key attention returns for v (its weight is exactly 1)."""
    e = 2.0**-8  # half an ulp of bf16 at 1.0
    x = np.array([1 + e, 1 + 3 * e, 1 + 1.5 * e, -(1 + e / 2), 1e-40, -1e-40, 3.0], np.float32)
    want = np.array([1.0, 1 + 4 * e, 1 + 2 * e, -1.0, 0.0, -0.0, 3.0], np.float32)
    got = htp.round_bf16(x)
    assert got.dtype == np.float32 and np.array_equal(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want))
    v = np.random.default_rng(3).standard_normal((1, 1, 48)).astype(np.float32)
    for simd in LEVELS:
        with mode(simd=simd):
            a = htp.attention(v[:, :, :16], v[:, :, :16], v, 0.5, products="bf16")
        assert np.array_equal(a, htp.round_bf16(v)), simd


def test_attention_products_checked() -> None:
    x = np.zeros((2, 1, 16), np.float32)
    with pytest.raises(htp.HTPInputError, match="products must be one of"):
        htp.attention(x, x, x, 0.25, products="f16")


def test_attention_long_sequence_threads_agree() -> None:
    rng = np.random.default_rng(0)
    t = 1030  # several key blocks, not a multiple of any tile
    q = rng.standard_normal((t, 4, 64)).astype(np.float32)
    k = rng.standard_normal((t, 2, 64)).astype(np.float32)
    v = rng.standard_normal((t, 2, 64)).astype(np.float32)
    with mode(threads=1):
        a = htp.attention(q, k, v, 0.125)
    with mode(threads=2):
        b = htp.attention(q, k, v, 0.125)
    assert np.array_equal(a, b)
    assert T.rel_l2(a, T.ref_attention(q, k, v, 0.125)) <= TOL
    for products in ("bf16", "bf16-pv"):
        with mode(threads=1):
            a = htp.attention(q, k, v, 0.125, products=products)
        with mode(threads=2):
            b = htp.attention(q, k, v, 0.125, products=products)
        assert np.array_equal(a, b)
        assert T.rel_l2(a, T.ref_attention(q, k, v, 0.125)) <= TOL_BF16


@pytest.mark.parametrize("simd", SIMD_PARAMS)
@given(n=st.integers(0, 300), seed=st.integers(0, 2**32 - 1))
def test_silu_swiglu(simd: str, n: int, seed: int) -> None:
    """Every level against float64, on lengths that leave vector tails, with gates far out in
    both tails of the sigmoid; each element gets the same bits wherever it sits in the row
    (the vector bodies run a short tail through the same code) and at every level (the scalar
    body's exp is the vector one's, fused multiply-adds and all)."""
    rng = np.random.default_rng(seed)
    g = (rng.standard_normal(n) * 5).astype(np.float32)
    g[rng.random(n) < 0.05] = rng.choice([-200.0, -90.0, -20.0, 0.0, 20.0, 90.0, 200.0])
    u = rng.standard_normal(n).astype(np.float32)
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    s = g64 / (1 + np.exp(-g64))
    with mode(simd=simd):
        a = htp.silu(g, out=np.full_like(g, np.nan))
        b = htp.swiglu(g, u, out=np.full_like(g, np.nan))
        b1 = htp.swiglu(g[1:].copy(), u[1:].copy())
    with mode(simd="portable"):
        pa = htp.silu(g)
        pb = htp.swiglu(g, u)
    assert _same_bits(a, pa) and _same_bits(b, pb)
    m = np.abs(g) <= 30  # relative error where silu is representable; absolute everywhere
    assert T.rel_l2(a[m], s[m]) <= TOL
    assert T.rel_l2(b[m], (s * u64)[m]) <= TOL
    assert np.abs(a - s).max(initial=0.0) <= 1e-5 * max(1.0, np.abs(s).max(initial=0.0))
    assert np.abs(b - s * u64).max(initial=0.0) <= 1e-5 * max(1.0, np.abs(s * u64).max(initial=0.0))
    assert b1.tobytes() == b[1:].tobytes()


@pytest.mark.parametrize("simd", SIMD_PARAMS)
@given(
    n=st.integers(0, 300),
    seed=st.integers(0, 2**32 - 1),
    alpha=st.sampled_from([1.702, 0.5, 3.0]),
    limit=st.sampled_from([7.0, 0.75, 30.0]),
)
def test_swiglu_oai(simd: str, n: int, seed: int, alpha: float, limit: float) -> None:
    """gpt-oss's clamped SwiGLU: every level gives the portable level's bits (the scalar and
    vector bodies share the exp and the clamps' ordered compares), in place too, and each
    element the same bits wherever it sits in the row; against float64 with both clamps
    reached and far tails of the sigmoid; a NaN input gives NaN at every level."""
    rng = np.random.default_rng(seed)
    g = (rng.standard_normal(n) * 2 * limit).astype(np.float32)
    u = (rng.standard_normal(n) * 2 * limit).astype(np.float32)
    g[rng.random(n) < 0.05] = rng.choice([-200.0, -90.0, -limit, 0.0, limit, 90.0])
    u[rng.random(n) < 0.05] = rng.choice([-limit, limit, 1e30])
    nan = rng.random(n) < 0.02
    g[nan & (rng.random(n) < 0.5)] = np.nan
    u[nan & ~np.isnan(g)] = np.nan
    with mode(simd=simd):
        a = htp.swiglu_oai(g, u, alpha, limit, out=np.full_like(g, -3.0))
        a1 = htp.swiglu_oai(g[1:].copy(), u[1:].copy(), alpha, limit)
        ip = u.copy()
        htp.swiglu_oai(g, ip, alpha, limit, out=ip)
    with mode(simd="portable"):
        p = htp.swiglu_oai(g, u, alpha, limit)
    assert _same_bits(a, p) and _same_bits(ip, a)
    assert a1.tobytes() == a[1:].tobytes()
    assert np.array_equal(np.isnan(a), nan)
    g64 = np.minimum(g.astype(np.float64), limit)
    u64 = np.clip(u.astype(np.float64), -limit, limit)
    ref = g64 / (1 + np.exp(-alpha * g64)) * (u64 + 1)
    ok = ~nan
    assert np.abs(a[ok] - ref[ok]).max(initial=0.0) <= 1e-5 * max(
        1.0, np.abs(ref[ok]).max(initial=0.0)
    )
    if n >= 200:  # the clamps were reached
        assert (g[ok] > limit).any() and (np.abs(u[ok]) > limit).any()


def test_swiglu_oai_refuses_bad_parameters_and_descriptors() -> None:
    """alpha and limit finite and > 0, matching shapes; the backend's one validator of the
    eltwise descriptor refuses an unknown activation, ReGLU (the expert op's only), SiLU with
    an activation, and SwiGLU with alpha or limit set, before reading anything."""
    g = np.ones(40, np.float32)
    for a, lim in ((0.0, 7.0), (1.7, float("inf")), (float("nan"), 7.0), (1.7, -1.0), ("x", 7)):
        with pytest.raises(htp.HTPInputError, match="alpha and limit"):
            htp.swiglu_oai(g, g, a, lim)  # type: ignore[arg-type]
    with pytest.raises(htp.HTPInputError, match="same shape"):
        htp.swiglu_oai(g, g[:39])
    be = htp.default_backend()
    out = np.zeros_like(g)

    def run(opcode: int, **fields: float) -> None:
        c = be.call(opcode)
        c.what = "swiglu_oai"
        c.p.eltwise.n = g.size
        for k, v in fields.items():
            setattr(c.p.eltwise, k, v)
        c.ref(g)
        if opcode == lib.HTP_OP_SWIGLU:
            c.ref(g)
        c.ref(out, "w")
        be.run(c)

    run(lib.HTP_OP_SWIGLU, glu=2, alpha=1.702, limit=7.0)  # the well-formed one runs
    assert out[0] == np.float32(htp.swiglu_oai(g[:1], g[:1])[0]) and out[0] != 0
    for opcode, fields, msg in (
        (lib.HTP_OP_SWIGLU, {"glu": 3}, "rejected"),
        (lib.HTP_OP_SWIGLU, {"glu": 2, "alpha": float("nan"), "limit": 7.0}, "rejected"),
        (lib.HTP_OP_SWIGLU, {"glu": 2, "alpha": 1.0, "limit": 0.0}, "rejected"),
        (lib.HTP_OP_SWIGLU, {"glu": 1}, "malformed descriptor"),
        (lib.HTP_OP_SWIGLU, {"alpha": 1.0}, "malformed descriptor"),
        (lib.HTP_OP_SILU, {"glu": 2, "alpha": 1.0, "limit": 7.0}, "malformed descriptor"),
    ):
        with pytest.raises(htp.HTPError, match=msg):
            run(opcode, **fields)


@given(
    t=st.integers(1, 12),
    e=st.integers(1, 40),
    data=st.data(),
    gating=st.sampled_from(["softmax", "sigmoid"]),
    norm=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    ties=st.booleans(),
    use_bias=st.booleans(),
)
def test_router_topk(t, e, data, gating, norm, seed, ties, use_bias) -> None:
    rng = np.random.default_rng(seed)
    k = data.draw(st.integers(1, e))
    logits = rng.standard_normal((t, e)).astype(np.float32)
    if ties:
        logits = np.round(logits).astype(np.float32)  # many equal values: lower id must win
    bias = rng.standard_normal(e).astype(np.float32) if use_bias and gating == "sigmoid" else None
    ids, w = htp.router_topk(logits, k, gating, norm, 2.5, bias)
    rids, rw = T.ref_router_topk(logits, k, gating, norm, 2.5, bias)
    assert np.array_equal(ids, rids)
    assert T.rel_l2(w, rw) <= TOL


@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
def test_router_topk_rows_split_across_threads(gating: str) -> None:
    """Enough rows for the pool's threads (t x experts >= 16K): the ids of the float64
    reference (ties -> lower id, rounded logits make many), weights within TOL, and the same
    bits from one thread and from two."""
    rng = np.random.default_rng(9)
    t, e, k = 611, 64, 8
    logits = rng.standard_normal((t, e)).astype(np.float32)
    logits[::3] = np.round(logits[::3])  # every third row full of ties
    bias = rng.standard_normal(e).astype(np.float32) if gating == "sigmoid" else None
    rids, rw = T.ref_router_topk(logits, k, gating, True, 2.5, bias)
    out = []
    for n in (1, 2):
        with htp.Backend("host", n_threads=n) as be:
            ids = np.full((t, k), -7, np.int32)
            w = np.full((t, k), np.nan, np.float32)
            htp.router_topk(logits, k, gating, True, 2.5, bias, out=(ids, w), backend=be)  # type: ignore[arg-type]
        assert np.array_equal(ids, rids), f"{n} thread(s)"
        assert T.rel_l2(w, rw) <= TOL
        out.append((ids.tobytes(), w.tobytes()))
    assert out[0] == out[1]


def test_router_mixtral_equivalence() -> None:
    # softmax + norm over top-k equals softmax over the top-k logits
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((5, 8)).astype(np.float32)
    ids, w = htp.router_topk(logits, 2, norm=True)
    top = np.take_along_axis(logits.astype(np.float64), ids, 1)
    sm = np.exp(top - top.max(1, keepdims=True))
    assert T.rel_l2(w, sm / sm.sum(1, keepdims=True)) <= TOL


@given(
    t=st.integers(0, 40),
    ch=st.integers(1, 70),
    taps=st.integers(1, 5),
    with_state=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_conv1d_causal(t: int, ch: int, taps: int, with_state: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, ch)).astype(np.float32)
    w = rng.standard_normal((ch, taps)).astype(np.float32)
    state = rng.standard_normal((taps - 1, ch)).astype(np.float32) if with_state else None
    out = np.full((t, ch), np.nan, np.float32)  # poisoned: an unwritten element fails
    y = htp.conv1d_causal(x, w, state, out=out)
    assert y is out
    ref = T.ref_conv1d_causal(x, w, state)
    assert y.shape == ref.shape == (t, ch) and np.isfinite(y).all()
    if t:
        assert np.abs(y - ref).max() <= TOL * max(1.0, float(np.abs(ref).max()))


def test_conv1d_causal_taps_and_history_by_hand() -> None:
    # One channel, taps (a, b, c): out[t] = a*s[t-2] + b*s[t-1] + c*s[t], the last tap on the
    # current token; a state supplies the two rows before x, its absence means zeros.
    x = np.array([[1.0], [10.0], [100.0]], np.float32)
    w = np.array([[2.0, 3.0, 5.0]], np.float32)
    assert htp.conv1d_causal(x, w)[:, 0].tolist() == [5.0, 53.0, 532.0]
    st_ = np.array([[1000.0], [10000.0]], np.float32)
    assert htp.conv1d_causal(x, w, st_)[:, 0].tolist() == [
        2000 + 30000 + 5,
        20000 + 3 + 50,
        2 + 30 + 500,
    ]
    # Continuing from the last taps-1 rows of a prefix equals convolving the whole sequence.
    rng = np.random.default_rng(3)
    seq = rng.standard_normal((29, 37)).astype(np.float32)
    wk = rng.standard_normal((37, 4)).astype(np.float32)
    whole = htp.conv1d_causal(seq, wk)
    tail = htp.conv1d_causal(np.ascontiguousarray(seq[11:]), wk, np.ascontiguousarray(seq[8:11]))
    assert np.array_equal(whole[11:], tail)


def test_conv1d_causal_rejects_bad_input() -> None:
    x = np.zeros((3, 8), np.float32)
    w = np.zeros((8, 3), np.float32)
    with pytest.raises(htp.HTPInputError, match=r"w must be \[C=8"):
        htp.conv1d_causal(x, np.zeros((7, 3), np.float32))
    with pytest.raises(htp.HTPInputError, match=r"taps >= 1"):
        htp.conv1d_causal(x, np.zeros((8, 0), np.float32))
    with pytest.raises(htp.HTPInputError, match=r"state must be \[taps-1=2, C=8\]"):
        htp.conv1d_causal(x, w, np.zeros((3, 8), np.float32))
    with pytest.raises(htp.HTPInputError, match="float32"):
        htp.conv1d_causal(x.astype(np.float64), w)  # type: ignore[arg-type]
    with pytest.raises(htp.HTPInputError, match="C-contiguous"):
        htp.conv1d_causal(np.zeros((8, 3), np.float32).T, w)
    with pytest.raises(htp.HTPInputError, match="shape"):
        htp.conv1d_causal(x, w, out=np.zeros((3, 7), np.float32))
    with pytest.raises(htp.HTPInputError, match="at least one channel"):
        htp.conv1d_causal(np.zeros((3, 0), np.float32), np.zeros((0, 3), np.float32))


@pytest.mark.parametrize("fmt", ["q4_0-t32r4", "q8_0-t32r4", "f16", "f32"])
@given(
    n=st.integers(1, 70), kb=st.integers(1, 4), t=st.integers(1, 10), seed=st.integers(0, 2**32 - 1)
)
def test_get_rows(fmt: str, n: int, kb: int, t: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    k = 32 * kb
    w = rng.standard_normal((n, k)).astype(np.float32)
    if fmt == "q4_0-t32r4":
        table, dense = T.pack_q4_0_t32r4(w), None
    elif fmt == "q8_0-t32r4":
        table, dense = T.pack_q8_0_t32r4(w), None
    elif fmt == "f16":
        table = w.astype(np.float16)
        dense = table.astype(np.float32)
    else:
        table, dense = w, w
    if dense is None:
        dense = T.dequantize_tiles(table, fmt, n, k)
    ids = rng.integers(0, n, t).astype(np.int32)
    assert np.array_equal(htp.get_rows(table, fmt, n, k, ids), dense[ids])


@pytest.mark.parametrize("fmt", ["q4_k-t32r4", "q5_k-t32r4", "q6_k-t32r4", "iq4_xs-t32r4"])
@given(n=st.integers(1, 70), sb=st.integers(1, 2), t=st.integers(1, 10), seed=st.integers(0, 99))
def test_get_rows_kquant(fmt: str, n: int, sb: int, t: int, seed: int) -> None:
    """Embedding rows of a K-quant table (awkward row counts: padding rows) are the tiles'
    dequantized values bit for bit (llama.cpp's (d*sc)*q - dmin*m in fp32; IQ4_XS's
    (d*(ls - 32))*kv[code])."""
    rng = np.random.default_rng(seed)
    k = 256 * sb
    if fmt == "q4_k-t32r4":
        table = T.pack_q4_k_t32r4(T.random_q4_k_blocks(rng, n, k))
    elif fmt == "q5_k-t32r4":
        table = T.pack_q5_k_t32r4(T.random_q5_k_blocks(rng, n, k))
    elif fmt == "iq4_xs-t32r4":
        table = T.pack_iq4_xs_t32r4(T.random_iq4_xs_blocks(rng, n, k))
    else:
        table = T.pack_q6_k_t32r4(T.random_q6_k_blocks(rng, n, k))
    ids = rng.integers(0, n, t).astype(np.int32)
    out = np.full((t, k), np.nan, np.float32)
    got = htp.get_rows(table, fmt, n, k, ids, out)
    assert np.array_equal(got, T.dequantize_tiles(table, fmt, n, k)[ids])


@pytest.mark.parametrize(
    "fmt", ["mxfp4-t32r4", "iq4_nl-t32r4", "q4_1-t32r4", "q5_0-t32r4", "q5_1-t32r4"]
)
@given(n=st.integers(1, 70), kb=st.integers(1, 5), t=st.integers(1, 10), seed=st.integers(0, 99))
def test_get_rows_mxfp4(fmt: str, n: int, kb: int, t: int, seed: int) -> None:
    """Embedding rows of an MXFP4 table (awkward row counts: padding rows; subnormal scales in
    some blocks) are the tiles' dequantized values bit for bit (code value x 2^(e-128)); the
    same for IQ4_NL (d x kvalues_iq4nl[code]), Q4_1, Q5_0 and Q5_1 tables."""
    rng = np.random.default_rng(seed)
    k = 32 * kb
    if fmt == "mxfp4-t32r4":
        table = T.pack_mxfp4_t32r4(T.random_mxfp4_blocks(rng, n, k))
    elif fmt != "iq4_nl-t32r4":
        table = T.pack_q4_1_q5_t32r4(T.random_q4_1_q5_blocks(rng, n, k, fmt), fmt)
    else:
        table = T.pack_iq4_nl_t32r4(T.random_iq4_nl_blocks(rng, n, k))
    ids = rng.integers(0, n, t).astype(np.int32)
    out = np.full((t, k), np.nan, np.float32)
    got = htp.get_rows(table, fmt, n, k, ids, out)
    want = T.dequantize_tiles(table, fmt, n, k)[ids]
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_small_ops_reject_bad_input() -> None:
    x = np.zeros((3, 8), np.float32)
    with pytest.raises(htp.HTPInputError, match="shape"):
        htp.rms_norm(x, np.ones(7, np.float32), 1e-6)
    with pytest.raises(htp.HTPInputError, match="multiple of n_heads"):
        htp.rms_norm_heads(x, np.ones(3, np.float32), 3, 1e-6)
    with pytest.raises(htp.HTPInputError, match="n_rot"):
        htp.rope(np.zeros((2, 1, 8), np.float32), np.zeros(2, np.int32), 9, 1e4, 1.0, "normal")
    with pytest.raises(htp.HTPInputError, match="mode"):
        htp.rope(np.zeros((2, 1, 8), np.float32), np.zeros(2, np.int32), 8, 1e4, 1.0, "glm")  # type: ignore[arg-type]
    with pytest.raises(htp.HTPInputError, match="multiple of KV heads"):
        htp.attention(
            np.zeros((2, 3, 4), np.float32),
            np.zeros((2, 2, 4), np.float32),
            np.zeros((2, 2, 4), np.float32),
            1.0,
        )
    with pytest.raises(htp.HTPInputError, match="exceeds"):
        htp.router_topk(np.zeros((2, 4), np.float32), 5)
    with pytest.raises(htp.HTPInputError, match="ids must be in"):
        htp.get_rows(np.zeros((4, 32), np.float32), "f32", 4, 32, np.array([4], np.int32))
    with pytest.raises(htp.HTPInputError, match="needs"):
        htp.get_rows(np.zeros((4, 32), np.float32), "f32", 5, 32, np.array([0], np.int32))
    with pytest.raises(htp.HTPInputError, match="int32"):
        htp.get_rows(np.zeros((4, 32), np.float32), "f32", 4, 32, np.array([0], np.int64))


@settings(max_examples=30)
@given(
    t=st.integers(0, 40),
    k=st.integers(1, 70),
    n=st.integers(1, 50),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_matmul_f32_vs_float64(t: int, k: int, n: int, threads: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    with htp.Backend("host", n_threads=threads) as be:
        y = htp.matmul_f32(x, w, out=np.full((t, n), np.nan, np.float32), backend=be)
        y1 = htp.matmul_f32(x, w, backend=be)
    ref = x.astype(np.float64) @ w.astype(np.float64)
    mag = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64)
    assert np.all(np.abs(y - ref) <= 1e-6 * k * mag + 1e-30)
    assert y.tobytes() == y1.tobytes()
    # each output summed over k in order: the same as a sequential fp32 loop
    if t and k <= 8:
        seq = np.zeros((t, n), np.float32)
        for kk in range(k):
            seq += x[:, kk : kk + 1] * w[kk]
        assert y.tobytes() == seq.tobytes()


@pytest.mark.parametrize("simd", SIMD_PARAMS)
@pytest.mark.parametrize("threads", [1, 2])
def test_matmul_f32_sequential_bits_on_every_column_path(simd: str, threads: int) -> None:
    """Every column path (blocks of 64, 16, 8, single columns, and their mixes) at every SIMD
    level gives the bits of a sequential fp32 loop (each product rounded, then added, k in
    order), into a poisoned output, for awkward t, k, n."""
    rng = np.random.default_rng(17)
    with mode(simd=simd, threads=threads):
        for n in (1, 7, 8, 9, 16, 17, 24, 31, 32, 33, 63, 64, 65, 88, 130):
            for k in (1, 3, 37, 300):
                t = int(rng.integers(1, 14))
                x = rng.standard_normal((t, k)).astype(np.float32)
                w = rng.standard_normal((k, n)).astype(np.float32)
                y = htp.matmul_f32(x, w, out=np.full((t, n), np.nan, np.float32))
                seq = np.zeros((t, n), np.float32)
                for kk in range(k):
                    seq += x[:, kk : kk + 1] * w[kk]
                assert y.tobytes() == seq.tobytes(), (simd, t, k, n)


def test_matmul_f32_bad_input() -> None:
    x = np.ones((3, 4), np.float32)
    with pytest.raises(htp.HTPInputError, match="K=4"):
        htp.matmul_f32(x, np.ones((5, 2), np.float32))
    with pytest.raises(htp.HTPInputError):
        htp.matmul_f32(x, np.ones((4, 2), np.float64))
    with pytest.raises(htp.HTPInputError, match="shape"):
        htp.matmul_f32(x, np.ones((4, 2), np.float32), out=np.empty((3, 3), np.float32))


def _rope_fresh(x: np.ndarray, pos: np.ndarray, *args: object, **kw: object) -> np.ndarray:
    """`rope` on a copy of ``x`` by a new backend (no cos/sin table kept from earlier calls)."""
    y = x.copy()
    with htp.Backend("host", n_threads=2) as be:
        htp.rope(y, pos, *args, backend=be, **kw)  # type: ignore[arg-type]
    return y


def test_rope_table_reused_only_for_the_same_positions_and_rotation() -> None:
    """A backend keeps the last call's cos/sin table: calls at the same positions and rotation
    (q then k, layer after layer) reuse it, and any change of the positions' values (in the same
    array), their count or a rotation parameter makes a new one. Every call gives the bits a
    fresh backend gives, and those are within TOL of the float64 reference."""
    rng = np.random.default_rng(3)
    t, n_rot = 300, 64  # 300 x 32 pairs: the table is built by the pool's threads
    pos = rng.integers(0, 6000, t).astype(np.int32)
    yarn = dict(ext_factor=1.0, attn_factor=0.9, corr_dims=(3.0, 21.0))
    calls: list[tuple[np.ndarray, tuple, dict]] = [
        (pos, (n_rot, 10000.0, 1.0, "neox"), {}),
        (pos, (n_rot, 10000.0, 1.0, "neox"), {}),  # reused
        (pos, (n_rot, 10000.0, 1.0, "normal"), {}),  # reused: the table does not depend on mode
        (pos, (n_rot, 500000.0, 1.0, "neox"), {}),  # another base
        (pos, (n_rot, 500000.0, 0.25, "neox"), {}),  # another scale
        (pos, (n_rot, 500000.0, 0.25, "neox"), yarn),  # YaRN
        (pos, (n_rot, 500000.0, 0.25, "neox"), dict(yarn, attn_factor=1.1)),
        (pos, (n_rot - 8, 500000.0, 0.25, "neox"), dict(yarn, attn_factor=1.1)),  # fewer dims
        (pos[:-1], (n_rot - 8, 500000.0, 0.25, "neox"), dict(yarn, attn_factor=1.1)),  # fewer rows
    ]
    with htp.Backend("host", n_threads=2) as be:
        for i, (p_, args, kw) in enumerate(calls):
            x = rng.standard_normal((p_.shape[0], 3, n_rot + 4)).astype(np.float32)
            want = _rope_fresh(x, p_, *args, **kw)
            ref = T.ref_rope(x, p_, *args, **kw)  # type: ignore[arg-type]
            htp.rope(x, p_, *args, backend=be, **kw)  # type: ignore[arg-type]
            assert x.tobytes() == want.tobytes(), f"call {i}: not the bits of a fresh backend"
            assert T.rel_l2(x, ref) <= TOL, f"call {i}"
        # the same array, other values: the table must follow the values, not the address
        live = pos.copy()
        for step in range(3):
            live[step * 7 % t] += 1 + step
            x = rng.standard_normal((t, 2, n_rot)).astype(np.float32)
            want = _rope_fresh(x, live, n_rot, 10000.0, 1.0, "neox")
            htp.rope(x, live, n_rot, 10000.0, 1.0, "neox", backend=be)
            assert x.tobytes() == want.tobytes(), f"positions changed in place, step {step}"


def test_rope_above_the_table_limit_matches_the_reference() -> None:
    """Rows x pairs above the kept table's limit (2^20 pairs) are rotated from a per-call table,
    with the same bits as calls that keep one."""
    rng = np.random.default_rng(5)
    t, n_rot = 16500, 128  # 16500 x 64 pairs > 2^20
    pos = np.arange(t, dtype=np.int32)
    x = rng.standard_normal((t, 1, n_rot)).astype(np.float32)
    ref = T.ref_rope(x, pos, n_rot, 10000.0, 1.0, "neox")
    y = x.copy()
    with htp.Backend("host", n_threads=2) as be:
        htp.rope(y, pos, n_rot, 10000.0, 1.0, "neox", backend=be)
        z = x.copy()
        htp.rope(z, pos, n_rot, 10000.0, 1.0, "neox", backend=be)
    assert y.tobytes() == z.tobytes()
    assert T.rel_l2(y, ref) <= TOL
    small = x[:1000].copy()  # the first 1000 rows through a kept table: the same bits
    with htp.Backend("host", n_threads=2) as be:
        htp.rope(small, pos[:1000], n_rot, 10000.0, 1.0, "neox", backend=be)
    assert small.tobytes() == y[:1000].tobytes()
