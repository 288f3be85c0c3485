from __future__ import annotations

import numpy as np
import pytest
from helpers import LEVELS, SIMD_PARAMS, mode
from hypothesis import given
from hypothesis import strategies as st

import estream_htp as htp
from estream_htp import testing as T

F32_TOL = 1e-5
# int8 path against a float64 reference that applies the same Q8 rounding to x and to the SwiGLU
# output h: what remains are h elements that land on the other side of a rounding boundary
# because C computes h in fp32 (max 1.2e-3 measured over 300 random cases).
Q8_EMU_TOL = 5e-3
# int8 path against exact float64, for realistic widths (d=128): two Q8 roundings (x and h);
# 1.0e-2 measured at OLMoE shapes. Tiny widths (one 32-block) can exceed it by cancellation.
Q8_TOL = 3e-2


@st.composite
def scenarios(draw):
    d = 32 * draw(st.integers(1, 3))
    ff = 32 * draw(st.integers(1, 3))
    n_exp = draw(st.integers(1, 6))
    t = draw(st.integers(1, 19))
    kind = draw(st.sampled_from(["random", "one_route", "one_expert", "empty", "big"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "one_route":
        r = 1
    elif kind == "empty":
        r = 0
    elif kind == "big":
        r = draw(st.integers(20, 60))
    else:
        r = draw(st.integers(1, 30))
    tokens = rng.integers(0, t, r).astype(np.int32)
    routed = rng.choice(n_exp, size=draw(st.integers(1, n_exp)), replace=False)
    experts = (np.full(r, routed[0]) if kind == "one_expert" else rng.choice(routed, r)).astype(
        np.int32
    )
    weights = rng.uniform(-1, 1, r).astype(np.float32)
    capacity = draw(st.integers(1, max(1, r + 3)))
    return d, ff, n_exp, t, tokens, experts, weights, capacity, routed, rng


def _planes(rng, n_exp, d, ff, routed):
    """Experts placed at scattered slots of 3 planes (unrouted experts may be non-resident)."""
    gate, up, down = T.random_experts(rng, n_exp, d, ff)
    n_slots = n_exp + 3
    slots = rng.permutation(n_slots)[:n_exp].astype(np.int32)
    for e in range(n_exp):
        if e not in routed and rng.random() < 0.5:
            slots[e] = -1
    pad = lambda nb: -(-nb // 4096) * 4096  # noqa: E731 - contract: projections padded to 4 KiB
    planes = []
    for p in (gate, up, down):
        plane = np.zeros((n_slots, pad(p.shape[1])), dtype=np.uint8)
        for e in range(n_exp):
            if slots[e] >= 0:
                plane[slots[e], : p.shape[1]] = p[e]
        planes.append(plane)
    return (gate, up, down), planes, slots


def _run(g, x, tokens, experts, weights, slots, planes, y):
    g.run(
        x,
        tokens,
        experts,
        weights,
        slots,
        [p.ctypes.data for p in planes],
        [p.strides[0] for p in planes],
        y,
    )


@pytest.mark.parametrize("simd", SIMD_PARAMS)
@pytest.mark.parametrize("act", ["f32", "q8"])
@given(sc=scenarios())
def test_expert_op_matches_float64(simd: str, act: str, sc) -> None:
    d, ff, n_exp, t, tokens, experts, weights, capacity, routed, rng = sc
    (gate, up, down), planes, slots = _planes(rng, n_exp, d, ff, routed)
    x = rng.standard_normal((t, d)).astype(np.float32)
    y0 = rng.standard_normal((t, d)).astype(np.float32)  # the op accumulates into y
    ref = y0 + T.ref_expert_op(x, tokens, experts, weights, gate, up, down, ff)
    y = y0.copy()
    with mode(simd=simd, act=act), htp.ExpertGraph(d, ff, capacity, t_max=t + 2) as g:
        _run(g, x, tokens, experts, weights, slots, planes, y)
    if len(tokens):
        mag = T.ref_expert_op(x, tokens, experts, weights, gate, up, down, ff, magnitude=True)
        if act == "f32":
            assert T.rel_l2_floored(y - y0, ref - y0, mag, ff) <= F32_TOL
        else:
            emu = T.ref_expert_op(x, tokens, experts, weights, gate, up, down, ff, q8=True)
            assert T.rel_l2_floored(y - y0, emu, mag, ff) <= Q8_EMU_TOL
    else:
        assert np.array_equal(y, y0)


@pytest.mark.parametrize("act", ["f32", "q8"])
def test_expert_op_threads_bit_identical_and_paths_agree(act: str) -> None:
    rng = np.random.default_rng(5)
    d, ff, n_exp, t, r = 128, 96, 5, 41, 150
    tokens = rng.integers(0, t, r).astype(np.int32)
    experts = rng.integers(0, n_exp - 1, r).astype(np.int32)  # last expert gets no route
    weights = rng.uniform(0, 1, r).astype(np.float32)
    (gate, up, down), planes, slots = _planes(rng, n_exp, d, ff, list(range(n_exp)))
    x = rng.standard_normal((t, d)).astype(np.float32)
    ref = T.ref_expert_op(x, tokens, experts, weights, gate, up, down, ff)
    outs = {}
    for simd in LEVELS:
        for th in (1, 2):
            y = np.zeros((t, d), np.float32)
            with mode(simd=simd, act=act, threads=th), htp.ExpertGraph(d, ff, 64, t) as g:
                _run(g, x, tokens, experts, weights, slots, planes, y)
            outs[simd, th] = y
        assert np.array_equal(outs[simd, 1], outs[simd, 2]), simd
        assert T.rel_l2(y, ref) <= (F32_TOL if act == "f32" else Q8_TOL), simd
        tol = 1e-6 if act == "f32" else 1e-3  # q8: h re-quantization may round differently
        assert T.rel_l2(outs[simd, 1], outs["portable", 1]) <= tol, simd


@pytest.mark.skipif(not htp.simd_supported("amx"), reason="needs AMX-INT8 (hardware)")
def test_expert_op_amx_bits_equal_vnni() -> None:
    """Slots of 1..150 routes (token tiles with tails, a slot past the kernel's 64 tokens) and
    d_ff / d_model of 3 and 5 tiles: the AMX level's q8 expert op gives the VNNI level's bits."""
    rng = np.random.default_rng(8)
    d, ff, n_exp, t, r = 160, 96, 6, 90, 300
    experts = np.concatenate([np.full(150, 0), rng.integers(1, n_exp, r - 150)]).astype(np.int32)
    tokens = rng.integers(0, t, r).astype(np.int32)
    weights = rng.uniform(0, 1, r).astype(np.float32)
    (gate, up, down), planes, slots = _planes(rng, n_exp, d, ff, list(range(n_exp)))
    x = rng.standard_normal((t, d)).astype(np.float32)
    outs = {}
    for simd in ("avx512vnni", "amx"):
        y = np.full((t, d), 0.5, np.float32)
        with mode(simd=simd, act="q8", threads=2), htp.ExpertGraph(d, ff, 64, t) as g:
            _run(g, x, tokens, experts, weights, slots, planes, y)
        outs[simd] = y
    assert outs["amx"].tobytes() == outs["avx512vnni"].tobytes()
    emu = T.ref_expert_op(x, tokens, experts, weights, gate, up, down, ff, q8=True)
    mag = T.ref_expert_op(x, tokens, experts, weights, gate, up, down, ff, magnitude=True)
    assert T.rel_l2_floored(outs["amx"] - 0.5, emu, mag, ff) <= Q8_EMU_TOL


@pytest.mark.parametrize("act", ["f32", "q8"])
def test_expert_op_slot_with_more_routes_than_one_gemm_piece(act: str) -> None:
    """A slot with 300 routes is cut into pieces of 128 (gate/up work items with a non-zero
    first route); d_ff of 7 tiles leaves a ragged last block of 4, d_model of 5 tiles a ragged
    down item. Against float64 and bit for bit across thread counts."""
    rng = np.random.default_rng(21)
    d, ff, n_exp, t, r = 160, 224, 3, 97, 420
    tokens = rng.integers(0, t, r).astype(np.int32)
    experts = np.where(np.arange(r) < 300, 1, rng.integers(0, n_exp, r)).astype(np.int32)
    rng.shuffle(experts)
    weights = rng.uniform(-1, 1, r).astype(np.float32)
    (gate, up, down), planes, slots = _planes(rng, n_exp, d, ff, list(range(n_exp)))
    x = rng.standard_normal((t, d)).astype(np.float32)
    mag = T.ref_expert_op(x, tokens, experts, weights, gate, up, down, ff, magnitude=True)
    if act == "f32":
        ref, tol = T.ref_expert_op(x, tokens, experts, weights, gate, up, down, ff), F32_TOL
    else:
        ref = T.ref_expert_op(x, tokens, experts, weights, gate, up, down, ff, q8=True)
        tol = Q8_EMU_TOL
    outs = []
    for th in (1, 2):
        y = np.full((t, d), 0.5, np.float32)
        with mode(act=act, threads=th), htp.ExpertGraph(d, ff, r, t) as g:
            _run(g, x, tokens, experts, weights, slots, planes, y)
        outs.append(y)
        assert T.rel_l2_floored(y - 0.5, ref, mag, ff) <= tol, th
    assert np.array_equal(outs[0], outs[1])


@pytest.mark.parametrize("act", ["f32", "q8"])
def test_expert_op_result_does_not_depend_on_capacity(act: str) -> None:
    # passes are cut along slots, and y receives contributions slot by slot in route order
    rng = np.random.default_rng(8)
    d, ff, n_exp, t, r = 64, 64, 4, 23, 90
    tokens = rng.integers(0, t, r).astype(np.int32)
    experts = rng.integers(0, n_exp, r).astype(np.int32)
    experts[:40] = 2  # one slot larger than the small capacities
    weights = rng.uniform(-1, 1, r).astype(np.float32)
    _, planes, slots = _planes(rng, n_exp, d, ff, list(range(n_exp)))
    x = rng.standard_normal((t, d)).astype(np.float32)
    outs = []
    for cap in (1, 7, 33, r, r + 5):
        y = np.zeros((t, d), np.float32)
        with mode(act=act), htp.ExpertGraph(d, ff, cap, t) as g:
            _run(g, x, tokens, experts, weights, slots, planes, y)
        outs.append(y)
    for y in outs[1:]:
        assert np.array_equal(y, outs[0])


def test_moe_ffn_matches_float64() -> None:
    rng = np.random.default_rng(11)
    d, ff, n_exp, t, k = 64, 96, 6, 13, 3
    gate, up, down = T.random_experts(rng, n_exp, d, ff)
    x = rng.standard_normal((t, d)).astype(np.float32)
    logits = rng.standard_normal((t, n_exp)).astype(np.float32)
    ids, w = htp.router_topk(logits, k, norm=True)
    ref = T.ref_expert_op(
        x, np.repeat(np.arange(t), k), ids.reshape(-1), w.reshape(-1), gate, up, down, ff
    )
    with mode(act="f32"):
        assert T.rel_l2(htp.moe_ffn(x, gate, up, down, ids, w), ref) <= F32_TOL
        assert T.rel_l2(htp.moe_ffn(x, gate, up, down, ids, w, ff=ff), ref) <= F32_TOL


def test_expert_op_errors() -> None:
    rng = np.random.default_rng(3)
    d, ff = 64, 64
    _, planes, _ = _planes(rng, 2, d, ff, [0, 1])
    x = np.zeros((4, d), np.float32)
    y = np.zeros((4, d), np.float32)
    tok = np.array([0, 1], np.int32)
    exp = np.array([0, 1], np.int32)
    w = np.ones(2, np.float32)
    with htp.ExpertGraph(d, ff, 8, 4) as g:
        with pytest.raises(htp.ExpertNotResidentError, match="expert 1"):
            _run(g, x, tok, exp, w, np.array([0, -1], np.int32), planes, y)
        with pytest.raises(htp.HTPInputError, match="tokens must be in"):
            _run(g, x, np.array([0, 4], np.int32), exp, w, np.array([0, 1], np.int32), planes, y)
        with pytest.raises(htp.HTPInputError, match="experts must be in"):
            _run(g, x, tok, np.array([0, 2], np.int32), w, np.array([0, 1], np.int32), planes, y)
        with pytest.raises(htp.CapacityError, match="t_max"):
            _run(
                g,
                np.zeros((5, d), np.float32),
                tok,
                exp,
                w,
                np.array([0, 1], np.int32),
                planes,
                np.zeros((5, d), np.float32),
            )
        with pytest.raises(htp.HTPInputError, match="same length"):
            _run(g, x, tok, exp[:1], w, np.array([0, 1], np.int32), planes, y)
        with pytest.raises(htp.HTPInputError, match="rejected"):  # stride smaller than a matrix
            g.run(
                x,
                tok,
                exp,
                w,
                np.array([0, 1], np.int32),
                [p.ctypes.data for p in planes],
                [64, 64, 64],
                y,
            )
        # no routes at all (also with zero tokens): y untouched, no error
        y1 = np.ones((4, d), np.float32)
        empty_i = np.zeros(0, np.int32)
        g.run(
            x,
            empty_i,
            empty_i,
            np.zeros(0, np.float32),
            np.zeros(0, np.int32),
            [1, 1, 1],
            [0, 0, 0],
            y1,
        )
        assert np.all(y1 == 1)
        g.run(np.zeros((0, d), np.float32), empty_i, empty_i, np.zeros(0, np.float32), np.array([0, 1], np.int32),
              [p.ctypes.data for p in planes], [p.strides[0] for p in planes], np.zeros((0, d), np.float32))  # fmt: skip
    with pytest.raises(htp.HTPInputError, match="closed"):
        _run(g, x, tok, exp, w, np.array([0, 1], np.int32), planes, y)
    with pytest.raises(htp.HTPInputError, match="multiple of 32"):
        htp.ExpertGraph(48, 64, 8, 4)


Q4, Q8 = "q4_0-t32r4", "q8_0-t32r4"
# every projection Q8_0; and the mixes a quantizer writes (another type for down only, or for
# gate and down)
Q4K, Q5K, Q6K = "q4_k-t32r4", "q5_k-t32r4", "q6_k-t32r4"
FORMAT_MIXES = [(Q8, Q8, Q8), (Q4, Q4, Q8), (Q8, Q4, Q8)]
# Q4_K_M's expert mix (Q4_K gate/up, Q6_K down), all Q6_K, and K-quants next to Q8_0 / Q4_0
KQ_MIXES = [(Q4K, Q4K, Q6K), (Q6K, Q6K, Q6K), (Q4K, Q4K, Q4K), (Q4K, Q8, Q4), (Q5K, Q5K, Q6K)]
# IQ4_XS experts (published MoE IQ4_XS files), and IQ4_XS next to a K-quant / IQ4_NL down
XS = "iq4_xs-t32r4"
KQ_MIXES += [(XS, XS, XS), (XS, XS, Q6K), (XS, Q4K, "iq4_nl-t32r4")]
# MXFP4 experts (gpt-oss), and MXFP4 next to another type
MX = "mxfp4-t32r4"
NL = "iq4_nl-t32r4"
Q41, Q50, Q51 = "q4_1-t32r4", "q5_0-t32r4", "q5_1-t32r4"
MX_MIXES = [(MX, MX, MX), (MX, MX, Q8), (Q4K, MX, Q6K), (NL, NL, NL), (NL, MX, Q8)]
MX_MIXES += [(Q41, Q41, Q41), (Q50, Q50, Q51), (Q51, Q4, Q50)]


@pytest.mark.parametrize("simd", SIMD_PARAMS)
@pytest.mark.parametrize("act", ["f32", "q8"])
@pytest.mark.parametrize("formats", FORMAT_MIXES + KQ_MIXES + MX_MIXES)
def test_expert_op_q8_0_and_kquant_weights_match_float64(simd: str, act: str, formats) -> None:
    """Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, MXFP4, IQ4_NL, Q4_1, Q5_0, Q5_1 weights (every projection, or
    mixed per projection) at awkward sizes (d_model 3 tiles and d_ff 5 tiles, or for K-quants 1
    and 2 super-blocks; 43 tokens, slots with 1..40 routes, padded planes): the op's
    accumulated result matches the float64 reference of the same tiles (f32 products), or that
    reference with the int8 activation rounding applied (q8); with a NaN-poisoned plane padding
    and 1 and 2 threads giving the same bits."""
    rng = np.random.default_rng(21)
    kq = any(f in (Q4K, Q5K, Q6K, XS) for f in formats)
    d, ff, n_exp, t = (256, 512, 5, 43) if kq else (96, 160, 5, 43)
    gate, up, down = T.random_experts(rng, n_exp, d, ff, formats)
    experts = np.concatenate([np.full(40, 2), [0], rng.integers(0, n_exp, 60)]).astype(np.int32)
    r = experts.size
    tokens = rng.integers(0, t, r).astype(np.int32)
    weights = rng.uniform(-1, 1, r).astype(np.float32)
    slots = np.array([4, 0, 6, 2, 5], np.int32)
    planes = []
    for p in (gate, up, down):
        stride = -(-p.shape[1] // 4096) * 4096
        plane = np.full((7, stride), 0xFF, np.uint8)  # 0xFFFF scales: NaN if ever read
        for e in range(n_exp):
            plane[slots[e], : p.shape[1]] = p[e]
        planes.append(plane)
    x = rng.standard_normal((t, d)).astype(np.float32)
    y0 = rng.standard_normal((t, d)).astype(np.float32)
    outs = []
    for th in (1, 2):
        y = y0.copy()
        with (
            mode(simd=simd, act=act, threads=th),
            htp.ExpertGraph(d, ff, 37, t, formats=formats) as g,
        ):
            _run(g, x, tokens, experts, weights, slots, planes, y)
        outs.append(y)
    assert np.array_equal(outs[0], outs[1])
    y = outs[0]
    assert np.isfinite(y).all()
    args = (x, tokens, experts, weights, gate, up, down, ff)
    mag = T.ref_expert_op(*args, magnitude=True, formats=formats)
    if act == "f32":
        ref = T.ref_expert_op(*args, formats=formats)
        assert T.rel_l2_floored(y - y0, ref, mag, ff) <= F32_TOL
    else:
        emu = T.ref_expert_op(*args, q8=True, formats=formats)
        assert T.rel_l2_floored(y - y0, emu, mag, ff) <= Q8_EMU_TOL


LQ_MIXES = [(NL, NL, NL), (XS, XS, XS), (Q41, Q41, Q41), (Q50, Q50, Q51), (Q51, Q41, Q50)]


@pytest.mark.parametrize("formats", LQ_MIXES)
def test_expert_op_lq_tables_give_portable_bits(formats) -> None:
    """IQ4_NL, IQ4_XS, Q4_1, Q5_0 and Q5_1 experts under int8 activations: every kernel table
    this CPU runs gives the portable table's bits (their int8 kernels keep the portable
    epilogue, SwiGLU and the re-quantization of h are the same on every table), at d_model and
    d_ff off the 32-row strips' 16 / 32 (3 and 5 tiles; IQ4_XS 1 and 2 super-blocks), 43 tokens
    (off the 4 / 6 / 64 token steps), slots of 1..40 routes, into an output holding values
    before the op, on 1 and 2 threads."""
    rng = np.random.default_rng(33)
    d, ff, n_exp, t = (256, 512, 4, 43) if XS in formats else (96, 160, 4, 43)
    gate, up, down = T.random_experts(rng, n_exp, d, ff, formats)
    experts = np.concatenate([np.full(40, 2), [0], rng.integers(0, n_exp, 50)]).astype(np.int32)
    tokens = rng.integers(0, t, experts.size).astype(np.int32)
    weights = rng.uniform(-1, 1, experts.size).astype(np.float32)
    slots = np.array([3, 0, 5, 1], np.int32)
    planes = []
    for p in (gate, up, down):
        plane = np.full((6, -(-p.shape[1] // 4096) * 4096), 0xFF, np.uint8)  # NaN if read
        for e in range(n_exp):
            plane[slots[e], : p.shape[1]] = p[e]
        planes.append(plane)
    x = rng.standard_normal((t, d)).astype(np.float32)
    y0 = rng.standard_normal((t, d)).astype(np.float32)
    outs = {}
    for simd in LEVELS:
        for th in (1, 2):
            y = y0.copy()
            with (
                mode(simd=simd, act="q8", threads=th),
                htp.ExpertGraph(d, ff, 37, t, formats=formats) as g,
            ):
                _run(g, x, tokens, experts, weights, slots, planes, y)
            outs[simd, th] = y
    base = outs["portable", 1]
    assert np.isfinite(base).all() and not np.array_equal(base, y0)
    for key, y in outs.items():
        assert np.array_equal(y.view(np.uint32), base.view(np.uint32)), key


def test_expert_op_formats_per_call() -> None:
    """One graph serves layers of different types: a call's `formats` gives the bits of a graph
    made for those formats (a Q4_K_M mix on a graph made for Q4_0), and a bad one is refused."""
    rng = np.random.default_rng(23)
    d, ff, n_exp, t = 256, 256, 3, 11
    fmts = (Q4K, Q4K, Q6K)
    gate, up, down = T.random_experts(rng, n_exp, d, ff, fmts)
    planes = [np.ascontiguousarray(p) for p in (gate, up, down)]
    tokens = rng.integers(0, t, 20).astype(np.int32)
    experts = rng.integers(0, n_exp, 20).astype(np.int32)
    weights = rng.uniform(0, 1, 20).astype(np.float32)
    slots = np.arange(n_exp, dtype=np.int32)
    x = rng.standard_normal((t, d)).astype(np.float32)
    ya, yb = np.zeros((t, d), np.float32), np.zeros((t, d), np.float32)
    with htp.ExpertGraph(d, ff, 64, t, formats=fmts) as g:
        _run(g, x, tokens, experts, weights, slots, planes, ya)
    with htp.ExpertGraph(d, ff, 64, t) as g:
        g.run(x, tokens, experts, weights, slots, [p.ctypes.data for p in planes],
              [p.strides[0] for p in planes], yb, formats=fmts)  # fmt: skip
        with pytest.raises(htp.HTPInputError, match="formats must be"):
            g.run(x, tokens, experts, weights, slots, [p.ctypes.data for p in planes],
                  [p.strides[0] for p in planes], yb, formats="q5_k")  # fmt: skip
    assert np.array_equal(ya, yb) and np.abs(ya).max() > 0


def test_expert_op_format_errors() -> None:
    """An unknown or unsupported expert format is refused by name; a stride that fits Q4_0
    tiles but not the larger Q8_0 ones is refused by the backend."""
    with pytest.raises(htp.HTPInputError, match="formats must be"):
        htp.ExpertGraph(64, 64, 8, 4, formats="q4_k")
    with pytest.raises(htp.HTPInputError, match="formats must be"):
        htp.ExpertGraph(64, 64, 8, 4, formats=(Q4, Q8))
    rng = np.random.default_rng(4)
    d, ff = 64, 64
    _, planes, _ = _planes(rng, 2, d, ff, [0, 1])  # Q4_0-sized slots (576 * 4 B each)
    x = np.zeros((4, d), np.float32)
    y = np.zeros((4, d), np.float32)
    two = np.array([0, 1], np.int32)
    q4_stride = [2 * 2 * 576] * 3
    g = htp.ExpertGraph(d, ff, 8, 4, formats=(Q4, Q4, Q8))
    with pytest.raises(htp.HTPInputError, match="rejected"):
        g.run(x, two, two, np.ones(2, np.float32), two,
              [p.ctypes.data for p in planes], q4_stride, y)  # fmt: skip


# ------------------------------------------------------------------ shared Q8 rows
@pytest.mark.parametrize("simd", SIMD_PARAMS)
@given(
    t=st.integers(0, 23),
    nb=st.integers(1, 7),
    seed=st.integers(0, 2**32 - 1),
    zero_block=st.booleans(),
)
def test_quantize_q8_matches_reference(simd: str, t: int, nb: int, seed: int, zero_block) -> None:
    """Values, scales and block sums against a float64 reading of the Q8 rule (d = amax/127,
    q = rint(x/d) in fp32); the output is poisoned first, and an all-zero block (d = 0) and
    block maxima (|q| = 127) occur."""
    rng = np.random.default_rng(seed)
    d = 32 * nb
    x = (rng.standard_normal((t, d)) * rng.uniform(0.01, 100)).astype(np.float32)
    if zero_block and t:
        x[rng.integers(0, t), :32] = 0.0
    out = htp.Q8Rows(t, d)
    out.data[:] = 0xA5  # poison
    with mode(simd=simd):
        got = htp.quantize_q8(x, out)
    assert got is out and got.shape == (t, d)
    q, sc, sm = got.parts()
    b = x.reshape(t, nb, 32)
    amax = np.abs(b).max(axis=2) if t else np.zeros((0, nb), np.float32)
    ref_d = (amax / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(ref_d != 0, np.float32(1.0) / ref_d, np.float32(0.0)).astype(np.float32)
    ref_q = np.rint(b * inv[..., None]).astype(np.int64)
    assert np.array_equal(sc, ref_d)
    assert np.array_equal(q.reshape(t, nb, 32).astype(np.int64), ref_q)
    assert np.array_equal(sm.astype(np.int64), ref_q.sum(axis=2))
    if t:  # dequantized, the rows are what the int8 path sees
        deq = q.reshape(t, nb, 32).astype(np.float64) * sc[..., None]
        assert np.array_equal(deq.reshape(t, d).astype(np.float32), T.ref_q8_activations(x))
        qmax = np.abs(q.reshape(t, nb, 32).astype(np.int64)).max(axis=2)
        assert np.array_equal(qmax, np.where(amax > 0, 127, 0))  # every nonzero block reaches 127


@pytest.mark.parametrize("simd", SIMD_PARAMS)
def test_expert_op_from_q8_rows_is_bit_identical(simd: str) -> None:
    """The groups of a streamed layer: the input quantized once, then one expert op per group
    of experts, each from the shared rows, gives the bits of each op quantizing x itself and
    of one op over every expert; on 1 and 2 threads."""
    rng = np.random.default_rng(8)
    d, ff, n_exp, t, r = 96, 160, 6, 37, 140
    tokens = rng.integers(0, t, r).astype(np.int32)
    experts = rng.integers(0, n_exp, r).astype(np.int32)
    weights = rng.uniform(0, 1, r).astype(np.float32)
    (gate, up, down), planes, slots = _planes(rng, n_exp, d, ff, list(range(n_exp)))
    x = rng.standard_normal((t, d)).astype(np.float32)
    # groups of 3 consecutive slots, routes in group order (as a streamed layer runs them):
    # contributions then reach y in the order of one op over every slot
    group = slots[experts] // 3
    order = np.argsort(group, kind="stable")
    tokens, experts, weights, group = tokens[order], experts[order], weights[order], group[order]
    outs = []
    for th in (1, 2):
        with mode(simd=simd, act="q8", threads=th), htp.ExpertGraph(d, ff, 64, t) as g:
            rows = htp.quantize_q8(x)
            y_all = np.full((t, d), 0.5, np.float32)
            _run(g, x, tokens, experts, weights, slots, planes, y_all)
            for src in (x, rows):
                y = np.full((t, d), 0.5, np.float32)
                for grp in np.unique(group):
                    sel = group == grp
                    _run(g, src, tokens[sel], experts[sel], weights[sel], slots, planes, y)
                outs.append(y)
            assert np.array_equal(outs[-2], outs[-1])
            assert np.array_equal(outs[-1], y_all)
    assert np.array_equal(outs[0], outs[2])
    emu = T.ref_expert_op(x, tokens, experts, weights, gate, up, down, ff, q8=True)
    mag = T.ref_expert_op(x, tokens, experts, weights, gate, up, down, ff, magnitude=True)
    assert T.rel_l2_floored(outs[-1] - 0.5, emu, mag, ff) <= Q8_EMU_TOL


def test_q8_rows_errors() -> None:
    rng = np.random.default_rng(4)
    d, ff = 64, 64
    _, planes, _ = _planes(rng, 2, d, ff, [0, 1])
    x = rng.standard_normal((4, d)).astype(np.float32)
    y = np.zeros((4, d), np.float32)
    tok, exp, w = np.array([0, 3], np.int32), np.array([0, 1], np.int32), np.ones(2, np.float32)
    slots = np.array([0, 1], np.int32)
    with pytest.raises(htp.HTPInputError, match="multiple of 32"):
        htp.quantize_q8(np.zeros((2, 40), np.float32))
    with pytest.raises(htp.HTPInputError, match="multiple of 32"):
        htp.Q8Rows(2, 40)
    with pytest.raises(htp.HTPInputError, match="holds 5 rows of 64"):
        htp.quantize_q8(x, htp.Q8Rows(5, d))
    with pytest.raises(htp.HTPInputError, match="must be a Q8Rows"):
        htp.quantize_q8(x, np.zeros(320, np.uint8))  # type: ignore[arg-type]
    rows = htp.quantize_q8(x)
    with htp.ExpertGraph(d, ff, 8, 4) as g:
        with mode(act="f32"), pytest.raises(htp.HTPInputError, match="needs act='q8'"):
            _run(g, rows, tok, exp, w, slots, planes, y)
        with mode(act="q8"):
            with pytest.raises(htp.HTPInputError, match="d_model=64"):
                _run(
                    g, htp.quantize_q8(np.zeros((4, 32), np.float32)), tok, exp, w, slots, planes, y
                )
            with pytest.raises(htp.HTPInputError, match="tokens must be in"):
                _run(g, htp.quantize_q8(x[:3]), tok, exp, w, slots, planes, y[:3])
    assert htp.q8_rows_nbytes(4, d) == rows.data.nbytes == 4 * (64 + 16)
    # over a caller's buffer (an activation pool's): the rows are written there, in place
    buf = np.full(htp.q8_rows_nbytes(4, d) + 8, 0xA5, np.uint8)
    mine = htp.quantize_q8(x, htp.Q8Rows(4, d, data=buf[:-8]))
    assert np.shares_memory(mine.data, buf) and np.array_equal(buf[:-8], rows.data)
    assert np.all(buf[-8:] == 0xA5)  # nothing written past the rows
    with pytest.raises(htp.HTPInputError, match="must be 320 writeable bytes, got 321"):
        htp.Q8Rows(4, d, data=np.zeros(321, np.uint8))
    with pytest.raises(htp.HTPInputError, match="data must have dtype uint8"):
        htp.Q8Rows(4, d, data=np.zeros(80, np.float32))  # type: ignore[arg-type]
