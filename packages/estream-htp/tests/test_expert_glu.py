"""The expert op's other gated activations (ReGLU, gpt-oss's SwiGLU-OAI) and per-expert f32
biases on gate, up and down: every kernel table against the float64 reference at awkward sizes,
into outputs that hold other values (the op accumulates; unrouted tokens keep theirs), the
tables' int8 results bit-identical to each other, and the descriptor's new fields checked once
by the library's validator."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import LEVELS, SIMD_PARAMS, mode
from hypothesis import given, settings
from test_expert import F32_TOL, Q8_EMU_TOL, Q8_TOL, _planes, scenarios

import estream_htp as htp
from estream_htp import testing as T

GLUS = ["swiglu", "reglu", "swiglu_oai"]


def _biases(rng: np.random.Generator, n_exp: int, d: int, ff: int, scale: float = 4.0):
    """Bias rows large enough that SwiGLU-OAI's clamps (at 7) engage for some elements."""
    return tuple(
        (scale * rng.standard_normal(shape)).astype(np.float32)
        for shape in ((n_exp, ff), (n_exp, ff), (n_exp, d))
    )


def _run(g, x, tokens, experts, weights, slots, planes, y, bias=None) -> None:
    g.run(
        x, tokens, experts, weights, slots, [p.ctypes.data for p in planes],
        [p.strides[0] for p in planes], y,
        biases=None if bias is None else htp.expert_biases(*bias),
    )  # fmt: skip


@pytest.mark.parametrize("simd", SIMD_PARAMS)
@pytest.mark.parametrize("act", ["f32", "q8"])
@pytest.mark.parametrize("glu", GLUS)
@pytest.mark.parametrize("with_bias", [False, True])
@settings(max_examples=15)
@given(sc=scenarios())
def test_glu_and_biases_match_float64(simd: str, act: str, glu: str, with_bias: bool, sc) -> None:
    """Each activation, with and without biases, on every table: within the SwiGLU op's
    tolerances of the float64 reference (f32 products: 1e-5; int8: the reference with the same
    Q8 roundings), accumulated onto y's previous values; tokens with no route keep theirs."""
    d, ff, n_exp, t, tokens, experts, weights, capacity, routed, rng = sc
    (gate, up, down), planes, slots = _planes(rng, n_exp, d, ff, routed)
    bias = _biases(rng, n_exp, d, ff) if with_bias else None
    x = (3.0 * rng.standard_normal((t, d))).astype(np.float32)
    y0 = rng.standard_normal((t, d)).astype(np.float32)
    y = y0.copy()
    with mode(simd=simd, act=act), htp.ExpertGraph(d, ff, capacity, t_max=t + 2, glu=glu) as g:
        _run(g, x, tokens, experts, weights, slots, planes, y, bias)
    kw = dict(glu=glu, biases=bias)
    untouched = np.setdiff1d(np.arange(t), tokens)
    assert np.array_equal(y[untouched], y0[untouched])
    if not len(tokens):
        return
    ref = T.ref_expert_op(x, tokens, experts, weights, gate, up, down, ff, **kw)
    mag = T.ref_expert_op(x, tokens, experts, weights, gate, up, down, ff, magnitude=True, **kw)
    if act == "f32":
        assert T.rel_l2_floored(y - y0, ref, mag, ff) <= F32_TOL
    else:
        emu = T.ref_expert_op(x, tokens, experts, weights, gate, up, down, ff, q8=True, **kw)
        assert T.rel_l2_floored(y - y0, emu, mag, ff) <= Q8_EMU_TOL


@pytest.mark.parametrize("act", ["f32", "q8"])
@pytest.mark.parametrize("glu", ["reglu", "swiglu_oai"])
def test_threads_bit_identical_and_tables_agree(act: str, glu: str) -> None:
    """ReGLU and SwiGLU-OAI with biases: each table gives the same bits on 1 and 2 threads,
    and every table the portable table's result within the SwiGLU op's cross-table bounds
    (the int8 partial sums are the same integers; fp32 accumulation orders differ); the
    input does reach SwiGLU-OAI's clamp and ReGLU's cut."""
    rng = np.random.default_rng(7)
    d, ff, n_exp, t, r = 96, 160, 5, 37, 120
    tokens = rng.integers(0, t, r).astype(np.int32)
    experts = rng.integers(0, n_exp, r).astype(np.int32)
    weights = rng.uniform(-1, 1, r).astype(np.float32)
    (gate, up, down), planes, slots = _planes(rng, n_exp, d, ff, list(range(n_exp)))
    bias = _biases(rng, n_exp, d, ff, scale=6.0)
    x = (3.0 * rng.standard_normal((t, d))).astype(np.float32)
    outs = {}
    for simd in LEVELS:
        for th in (1, 2):
            y = np.full((t, d), 0.25, np.float32)
            with mode(simd=simd, act=act, threads=th), htp.ExpertGraph(d, ff, 50, t, glu=glu) as g:
                _run(g, x, tokens, experts, weights, slots, planes, y, bias)
            outs[simd, th] = y
        assert np.array_equal(outs[simd, 1], outs[simd, 2]), simd
        tol = 1e-6 if act == "f32" else 1e-3  # q8: h re-quantization may round differently
        assert T.rel_l2(outs[simd, 1] - 0.25, outs["portable", 1] - 0.25) <= tol, simd
    ref = T.ref_expert_op(x, tokens, experts, weights, gate, up, down, ff, glu=glu, biases=bias)
    got = outs["portable", 1] - 0.25
    assert T.rel_l2(got, ref) <= (F32_TOL if act == "f32" else Q8_TOL)
    # the clamp at 7 (SwiGLU-OAI) and the cut at 0 (ReGLU) were reached by this input
    g0 = T.dequantize_tiles(gate[0], "q4_0-t32r4", ff, d) @ x[0] + bias[0][0]
    assert (g0 > 7).any() and (g0 < 0).any()


def test_biases_change_the_result_and_swiglu_without_biases_is_unchanged() -> None:
    """Zero biases give the op's bits without biases (the added rows are exact); non-zero ones
    change every routed token's output."""
    rng = np.random.default_rng(4)
    d, ff, n_exp, t = 64, 64, 3, 9
    tokens = np.arange(t, dtype=np.int32)
    experts = (np.arange(t) % n_exp).astype(np.int32)
    weights = np.ones(t, np.float32)
    _, planes, slots = _planes(rng, n_exp, d, ff, list(range(n_exp)))
    x = rng.standard_normal((t, d)).astype(np.float32)
    for glu in GLUS:
        ys = []
        for bias in (None, _biases(rng, n_exp, d, ff, 0.0), _biases(rng, n_exp, d, ff)):
            y = np.zeros((t, d), np.float32)
            with htp.ExpertGraph(d, ff, 16, t, glu=glu) as g:
                _run(g, x, tokens, experts, weights, slots, planes, y, bias)
            ys.append(y)
        assert np.array_equal(ys[0], ys[1]), glu
        assert (np.abs(ys[2] - ys[0]).max(axis=1) > 0).all(), glu


def test_glu_and_bias_errors() -> None:
    """Bad activation names and parameters, bias arrays of the wrong size, and descriptors
    whose new fields are out of range are one clear error each."""
    rng = np.random.default_rng(3)
    d, ff, n_exp, t = 64, 64, 2, 4
    _, planes, slots = _planes(rng, n_exp, d, ff, [0, 1])
    x = np.zeros((t, d), np.float32)
    tok, exp = np.array([0, 1], np.int32), np.array([0, 1], np.int32)
    w = np.ones(2, np.float32)
    with pytest.raises(htp.HTPInputError, match="glu must be one of"):
        htp.ExpertGraph(d, ff, 8, t, glu="geglu")
    for bad in ((0.0, 7.0), (1.702, float("inf")), (float("nan"), 7.0), ("x", 7.0), (1.0, None)):
        with pytest.raises(htp.HTPInputError, match="alpha and limit"):
            htp.ExpertGraph(d, ff, 8, t, glu="swiglu_oai", alpha=bad[0], limit=bad[1])
    g32 = htp.ExpertGraph(d, ff, 8, t, glu="swiglu_oai", alpha=np.float32(1.5), limit=np.int64(6))
    assert (g32.alpha, g32.limit) == (1.5, 6.0)
    with htp.ExpertGraph(d, ff, 8, t, glu="swiglu_oai") as g:
        y = np.zeros((t, d), np.float32)
        with pytest.raises(htp.HTPInputError, match="biases must hold"):
            g.run(x, tok, exp, w, slots, [p.ctypes.data for p in planes],
                  [p.strides[0] for p in planes], y, biases=np.zeros(10, np.float32))  # fmt: skip
        bias = htp.expert_biases(*_biases(rng, n_exp, d, ff))

        def corrupt(**fields) -> None:
            c = g._call(x, tok, exp, w, slots, [p.ctypes.data for p in planes],
                        [p.strides[0] for p in planes], y, None, None, bias)  # fmt: skip
            for k, v in fields.items():
                setattr(c.p.expert, k, v)
            g.backend.run(c)

        corrupt()  # the uncorrupted descriptor runs
        bad, past, malformed = "rejected", "past the end", "malformed descriptor"
        for fields, msg in (
            ({"glu": 3}, bad),
            ({"glu_alpha": float("nan")}, bad),
            ({"glu_limit": -1.0}, bad),
            ({"bias_up": 2}, bad),  # not a whole float
            ({"bias_down": 8 * n_exp * ff + 4}, past),  # down's rows would end past the array
            ({"bias_up": 1 << 62}, past),
            ({"glu": 0}, malformed),  # SwiGLU with alpha / limit set: unused fields must be 0
            ({"has_bias": 2}, malformed),
        ):
            with pytest.raises(htp.HTPError, match=msg):
                corrupt(**fields)
    with pytest.raises(htp.HTPInputError, match="E, d_ff"):
        htp.expert_biases(np.zeros((2, 64)), np.zeros((3, 64)), np.zeros((2, 64)))
