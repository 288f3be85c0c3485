"""The hexagon backend: the library compiled for Hexagon (v67 + HVX, freestanding runtime) runs
as the executor process under qemu-hexagon-static and maps the host's memfds itself.

Every op against the host backend's portable kernels (one thread): bit-identical where the
computation is the same integer and float operations in the same order (GEMMs, the expert op,
norms, attention, SiLU/SwiGLU, convolution, rows); within 1e-6 relative where the host's libm
differs from the runtime's (RoPE's cos/sin/pow, the router's exp), and everything against the
float64 references. Outputs are poisoned with NaN. Both of the executor's kernel tables run:
``portable`` (the same source as the host) and ``hvx``. Shapes stay tiny: emulation is slow."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator

import numpy as np
import pytest
from helpers import kquant_stress_case, needs_hexagon
from hypothesis import given, settings
from hypothesis import strategies as st

import estream_htp as htp
from estream_htp import testing as T

pytestmark = needs_hexagon

LEVELS = ["portable", "hvx"]
# nox -s hexagon: five times the examples
_X = 5 if os.environ.get("ESTREAM_HEXAGON_FULL", "").strip() == "1" else 1


# seconds a test may take before the run is ended (see _hang_guard)
HANG_S = 600


@pytest.fixture(autouse=True)
def _hang_guard(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test still running after `HANG_S` seconds ends the whole run, naming the test, with
    every thread's traceback, and kills the executors (`estream_htp.testing.end_run_after`): a
    hung Hexagon program fails the suite in bounded time instead of holding it until the CI
    job's limit."""
    capman = request.config.pluginmanager.getplugin("capturemanager")
    cancel = T.end_run_after(HANG_S, request.node.nodeid, capman.global_and_fixture_disabled)
    yield
    cancel()


@pytest.fixture(scope="module")
def host() -> Iterator[htp.Backend]:
    with htp.Backend("host", n_threads=1, simd="portable") as b:
        yield b


@pytest.fixture(scope="module", params=LEVELS)
def hexagon(request: pytest.FixtureRequest) -> Iterator[htp.Backend]:
    with htp.Backend("hexagon", simd=request.param) as b:
        assert b.simd == request.param and b.n_threads == 1
        yield b


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _nan(shape: tuple[int, ...]) -> np.ndarray:
    return np.full(shape, np.nan, np.float32)


def test_the_executor_is_a_hexagon_program_under_qemu(hexagon: htp.Backend) -> None:
    assert hexagon.pid is not None
    with open(f"/proc/{hexagon.pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    assert b"qemu-hexagon" in argv[0] and b"-cpu" in argv
    with open(argv[argv.index(b"-cpu") + 2], "rb") as f:
        elf = f.read(20)
    assert elf[:4] == b"\x7fELF" and int.from_bytes(elf[18:20], "little") == 164  # EM_QDSP6


@settings(max_examples=12 * _X)
@given(
    n=st.integers(1, 70),
    kb=st.integers(1, 4),
    t=st.integers(1, 9),
    fmt=st.sampled_from(["q4_0-t32r4", "q8_0-t32r4"]),
    act=st.sampled_from(["q8", "f32"]),
    seed=st.integers(0, 2**16),
)
def test_gemm_bit_exact(
    host: htp.Backend, hexagon: htp.Backend, n: int, kb: int, t: int, fmt: str, act: str, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    k = 32 * kb
    w = rng.standard_normal((n, k)).astype(np.float32)
    buf = htp.pack_q4_0_t32r4(w) if fmt == "q4_0-t32r4" else htp.pack_q8_0_t32r4(w)
    x = rng.standard_normal((t, k)).astype(np.float32)
    a = htp.gemm(x, buf, n, fmt, out=_nan((t, n)), act=act, backend=host)
    b = htp.gemm(x, buf, n, fmt, out=_nan((t, n)), act=act, backend=hexagon)
    assert _same(a, b)
    mag = T.ref_gemm_magnitude(x, buf, n, fmt)
    if act == "f32":
        assert T.rel_l2_floored(b, T.ref_gemm(x, buf, n, fmt), mag, k) < 1e-5
    else:  # exact for the int8-rounded activations the kernel sees
        xq = T.ref_q8_activations(x)
        assert T.rel_l2_floored(b, T.ref_gemm(xq, buf, n, fmt), mag, k) < 1e-5


@settings(max_examples=4 * _X)
@given(
    n=st.integers(1, 40),
    t=st.integers(1, 6),
    kb=st.integers(1, 3),
    fmt=st.sampled_from(["f16-t32r4", "bf16-t32r4"]),
    act=st.sampled_from(["q8", "f32"]),
    seed=st.integers(0, 2**16),
)
def test_gemm_and_rows_of_float_tiles_bit_exact(
    host: htp.Backend, hexagon: htp.Backend, n: int, t: int, kb: int, fmt: str, act: str, seed: int
) -> None:
    """F16 / BF16 tiles (subnormal values, padding rows): the executor's GEMM (fp32 under
    either act) and embedding rows give the host's bits, the GEMM the float64 product of the
    exact values to fp32 rounding."""
    rng = np.random.default_rng(seed)
    k = 32 * kb
    buf = T.random_f16_t32r4(rng, n, k, fmt)
    x = rng.standard_normal((t, k)).astype(np.float32)
    a = htp.gemm(x, buf, n, fmt, out=_nan((t, n)), act=act, backend=host)
    b = htp.gemm(x, buf, n, fmt, out=_nan((t, n)), act=act, backend=hexagon)
    assert _same(a, b)
    mag = T.ref_gemm_magnitude(x, buf, n, fmt)
    assert T.rel_l2_floored(b, T.ref_gemm(x, buf, n, fmt), mag, k) < 1e-5
    ids = rng.integers(0, n, size=t).astype(np.int32)
    ra = htp.get_rows(buf, fmt, n, k, ids, _nan((t, k)), backend=host)
    rb = htp.get_rows(buf, fmt, n, k, ids, _nan((t, k)), backend=hexagon)
    assert _same(ra, rb) and _same(ra, htp.dequantize_tiles(buf, fmt, n, k)[ids])


@settings(max_examples=4 * _X)
@given(
    n=st.integers(1, 40),
    t=st.integers(1, 6),
    fmt=st.sampled_from(["q4_k-t32r4", "q5_k-t32r4", "q6_k-t32r4", "iq4_xs-t32r4"]),
    act=st.sampled_from(["q8", "f32"]),
    seed=st.integers(0, 2**16),
)
def test_gemm_kquant_bit_exact(
    host: htp.Backend, hexagon: htp.Backend, n: int, t: int, fmt: str, act: str, seed: int
) -> None:
    """Q4_K / Q5_K / Q6_K / IQ4_XS tiles (one super-block of K, padding rows): the executor's GEMM
    gives the host's bits, and the float64 reference of the tiles (with the int8-rounded
    activations on the q8 path) to fp32 rounding."""
    rng = np.random.default_rng(seed)
    k = 256
    if fmt == "q4_k-t32r4":
        buf = T.pack_q4_k_t32r4(T.random_q4_k_blocks(rng, n, k))
    elif fmt == "q5_k-t32r4":
        buf = T.pack_q5_k_t32r4(T.random_q5_k_blocks(rng, n, k))
    elif fmt == "iq4_xs-t32r4":
        buf = T.pack_iq4_xs_t32r4(T.random_iq4_xs_blocks(rng, n, k))
    else:
        buf = T.pack_q6_k_t32r4(T.random_q6_k_blocks(rng, n, k))
    x = rng.standard_normal((t, k)).astype(np.float32)
    a = htp.gemm(x, buf, n, fmt, out=_nan((t, n)), act=act, backend=host)
    b = htp.gemm(x, buf, n, fmt, out=_nan((t, n)), act=act, backend=hexagon)
    assert _same(a, b)
    xr = x if act == "f32" else T.ref_q8_activations(x)
    mag = T.ref_gemm_magnitude(xr, buf, n, fmt)
    assert T.rel_l2_floored(b, T.ref_gemm(xr, buf, n, fmt), mag, k) < 1e-5


@pytest.mark.parametrize("fmt", ["q4_k-t32r4", "q5_k-t32r4", "q6_k-t32r4"])
def test_gemm_kquant_stress_bit_exact(host: htp.Backend, hexagon: htp.Backend, fmt: str) -> None:
    """Q4_K / Q5_K / Q6_K tiles whose scales stress the fp32 epilogue's rounding (helpers'
    kquant_stress_case: scales over four decades, extreme 6-bit scales and mins, activations
    over six decades), 2 super-blocks, 7 tokens, 37 rows: the executor's int8 GEMM gives the
    host's bits."""
    _, buf, x = kquant_stress_case(7, 37, 2, 11, fmt)
    a = htp.gemm(x, buf, 37, fmt, out=_nan((7, 37)), act="q8", backend=host)
    b = htp.gemm(x, buf, 37, fmt, out=_nan((7, 37)), act="q8", backend=hexagon)
    assert np.isfinite(a).all() and _same(a, b)


@settings(max_examples=4 * _X)
@given(
    n=st.integers(1, 40),
    t=st.integers(1, 6),
    kb=st.integers(1, 3),
    act=st.sampled_from(["q8", "f32"]),
    seed=st.integers(0, 2**16),
)
@pytest.mark.parametrize(
    "fmt", ["mxfp4-t32r4", "iq4_nl-t32r4", "q4_1-t32r4", "q5_0-t32r4", "q5_1-t32r4"]
)
def test_gemm_mxfp4_bit_exact(
    host: htp.Backend, hexagon: htp.Backend, fmt: str, n: int, t: int, kb: int, act: str, seed: int
) -> None:
    """MXFP4 tiles (any codes, subnormal scales in some blocks, padding rows) and IQ4_NL tiles:
    the executor's GEMM gives the host's bits (the host's SIMD kernel keeps the portable
    epilogue), and the float64 reference of the tiles (with the int8-rounded activations on the
    q8 path) to fp32 rounding."""
    rng = np.random.default_rng(seed)
    k = 32 * kb
    if fmt == "mxfp4-t32r4":
        buf = T.pack_mxfp4_t32r4(T.random_mxfp4_blocks(rng, n, k))
    elif fmt != "iq4_nl-t32r4":
        buf = T.pack_q4_1_q5_t32r4(T.random_q4_1_q5_blocks(rng, n, k, fmt), fmt)
    else:
        buf = T.pack_iq4_nl_t32r4(T.random_iq4_nl_blocks(rng, n, k))
    x = rng.standard_normal((t, k)).astype(np.float32)
    a = htp.gemm(x, buf, n, fmt, out=_nan((t, n)), act=act, backend=host)
    b = htp.gemm(x, buf, n, fmt, out=_nan((t, n)), act=act, backend=hexagon)
    assert _same(a, b)
    xr = x if act == "f32" else T.ref_q8_activations(x)
    mag = T.ref_gemm_magnitude(xr, buf, n, fmt)
    assert T.rel_l2_floored(b, T.ref_gemm(xr, buf, n, fmt), mag, k) < 1e-5


@pytest.mark.parametrize("act", ["q8", "f32"])
def test_gemm_shared_bit_exact(host: htp.Backend, hexagon: htp.Backend, act: str) -> None:
    """Three matrices sharing one input in one op (x quantized once in the DSP process)."""
    rng = np.random.default_rng(3)
    k, t = 64, 5
    x = rng.standard_normal((t, k)).astype(np.float32)
    mats = [
        (htp.pack_q4_0_t32r4(rng.standard_normal((n, k)).astype(np.float32)), n)
        for n in (40, 32, 7)
    ]
    outs = [_nan((t, n)) for _, n in mats]
    a = htp.gemm_shared(x, mats, outs=[o.copy() for o in outs], act=act, backend=host)
    b = htp.gemm_shared(x, mats, outs=[o.copy() for o in outs], act=act, backend=hexagon)
    for ya, yb, (w, n) in zip(a, b, mats, strict=True):
        assert _same(ya, yb)
        assert _same(yb, htp.gemm(x, w, n, out=_nan((t, n)), act=act, backend=host))


@pytest.mark.parametrize("act", ["q8", "f32"])
def test_gemm_with_zero_subnormal_and_extreme_scales(
    host: htp.Backend, hexagon: htp.Backend, act: str
) -> None:
    """The HVX kernel converts a tile's f16 row scales branch-free for normal numbers and zeros
    and falls back to the general conversion when a tile holds a subnormal."""
    rng = np.random.default_rng(21)
    n, k, t = 64, 96, 5
    blocks = T.random_q4_0_blocks(rng, n, k)
    special = [0x0000, 0x8000, 0x0001, 0x03FF, 0x8200, 0x0400, 0x7BFF, 0xFBFF, 0x3C00]
    for i, h in enumerate(special):  # rows of the first row tile, tiles 0 and 2
        blocks[3 * i, 0, :2] = np.frombuffer(np.uint16(h).tobytes(), np.uint8)
        blocks[3 * i + 1, 2, :2] = np.frombuffer(np.uint16(h).tobytes(), np.uint8)
    blocks[40:, :, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # all normal
    buf = htp.pack_q4_0_t32r4(blocks)
    x = (rng.standard_normal((t, k)) * 1e-3).astype(np.float32)
    a = htp.gemm(x, buf, n, out=_nan((t, n)), act=act, backend=host)
    b = htp.gemm(x, buf, n, out=_nan((t, n)), act=act, backend=hexagon)
    assert _same(a, b) and np.isfinite(b).all()


@settings(max_examples=8 * _X)
@given(
    t=st.integers(1, 12),
    n_e=st.integers(1, 5),
    k=st.integers(1, 3),
    ffb=st.integers(1, 2),
    act=st.sampled_from(["q8", "f32"]),
    seed=st.integers(0, 2**16),
)
def test_expert_op_bit_exact(
    host: htp.Backend,
    hexagon: htp.Backend,
    t: int,
    n_e: int,
    k: int,
    ffb: int,
    act: str,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    d, ff = 64, 32 * ffb
    k = min(k, n_e)
    gate, up, down = T.random_experts(rng, n_e, d, ff)
    x = rng.standard_normal((t, d)).astype(np.float32)
    ids = np.stack([rng.permutation(n_e)[:k] for _ in range(t)]).astype(np.int32)
    wts = rng.random((t, k)).astype(np.float32)
    a = htp.moe_ffn(x, gate, up, down, ids, wts, act=act, backend=host)
    b = htp.moe_ffn(x, gate, up, down, ids, wts, act=act, backend=hexagon)
    assert _same(a, b) and np.isfinite(b).all()
    if act == "f32":
        tokens = np.repeat(np.arange(t, dtype=np.int32), k)
        ref = T.ref_expert_op(x, tokens, ids.reshape(-1), wts.reshape(-1), gate, up, down, ff)
        assert T.rel_l2(b, ref) < 1e-5


@settings(max_examples=4 * _X)
@given(
    t=st.integers(1, 9),
    n_e=st.integers(1, 4),
    formats=st.sampled_from(
        [
            ("q8_0-t32r4",) * 3,
            ("q4_0-t32r4", "q4_0-t32r4", "q8_0-t32r4"),
            ("q4_k-t32r4", "q4_k-t32r4", "q6_k-t32r4"),
            ("q6_k-t32r4", "q4_k-t32r4", "q8_0-t32r4"),
            ("mxfp4-t32r4",) * 3,
            ("mxfp4-t32r4", "mxfp4-t32r4", "q6_k-t32r4"),
            ("q5_k-t32r4", "q5_k-t32r4", "q6_k-t32r4"),
            ("iq4_nl-t32r4", "iq4_nl-t32r4", "q8_0-t32r4"),
            ("q4_1-t32r4", "q5_1-t32r4", "q5_0-t32r4"),
            ("iq4_xs-t32r4", "iq4_xs-t32r4", "q6_k-t32r4"),
        ]
    ),
    act=st.sampled_from(["q8", "f32"]),
    seed=st.integers(0, 2**16),
)
def test_expert_op_q8_0_and_kquant_weights_bit_exact(
    host: htp.Backend,
    hexagon: htp.Backend,
    t: int,
    n_e: int,
    formats: tuple[str, str, str],
    act: str,
    seed: int,
) -> None:
    """Q8_0, Q4_K, Q6_K, IQ4_XS and MXFP4 expert weights (all projections, or mixed as Q4_K_M
    mixes them): the executor gives the host's bits, and with f32 products the float64
    reference within 1e-5."""
    rng = np.random.default_rng(seed)
    kq = any(f.startswith(("q4_k", "q5_k", "q6_k", "iq4_xs")) for f in formats)
    d, ff, k = (256, 256, min(2, n_e)) if kq else (64, 64, min(2, n_e))
    gate, up, down = T.random_experts(rng, n_e, d, ff, formats)
    x = rng.standard_normal((t, d)).astype(np.float32)
    ids = np.stack([rng.permutation(n_e)[:k] for _ in range(t)]).astype(np.int32)
    wts = rng.random((t, k)).astype(np.float32)
    a = htp.moe_ffn(x, gate, up, down, ids, wts, act=act, backend=host, formats=formats)
    b = htp.moe_ffn(x, gate, up, down, ids, wts, act=act, backend=hexagon, formats=formats)
    assert _same(a, b) and np.isfinite(b).all()
    if act == "f32":
        tokens = np.repeat(np.arange(t, dtype=np.int32), k)
        ref = T.ref_expert_op(
            x, tokens, ids.reshape(-1), wts.reshape(-1), gate, up, down, ff, formats=formats
        )
        assert T.rel_l2(b, ref) < 1e-5


@pytest.mark.parametrize("act", ["q8", "f32"])
def test_iq4_xs_gemm_and_expert_op_bit_exact(
    host: htp.Backend, hexagon: htp.Backend, act: str
) -> None:
    """IQ4_XS tiles (two super-blocks of K, padding rows, sub-block scales -32 and 31): the
    executor's GEMM and expert op (IQ4_XS gate/up, Q6_K down) give the host's bits, and the
    float64 references of the tiles (int8-rounded activations on the q8 path) within 1e-5."""
    rng = np.random.default_rng(23)
    n, k, t = 45, 512, 5
    blocks = T.random_iq4_xs_blocks(rng, n, k)
    blocks[:2, :, 2:8] = np.array([[0] * 6, [0xFF] * 6], np.uint8)[:, None, :]
    buf = T.pack_iq4_xs_t32r4(blocks)
    x = rng.standard_normal((t, k)).astype(np.float32)
    fmt = "iq4_xs-t32r4"
    a = htp.gemm(x, buf, n, fmt, out=_nan((t, n)), act=act, backend=host)
    b = htp.gemm(x, buf, n, fmt, out=_nan((t, n)), act=act, backend=hexagon)
    assert _same(a, b)
    xr = x if act == "f32" else T.ref_q8_activations(x)
    mag = T.ref_gemm_magnitude(xr, buf, n, fmt)
    assert T.rel_l2_floored(b, T.ref_gemm(xr, buf, n, fmt), mag, k) < 1e-5
    formats = (fmt, fmt, "q6_k-t32r4")
    gate, up, down = T.random_experts(rng, 3, 256, 256, formats)
    xe = rng.standard_normal((t, 256)).astype(np.float32)
    ids = np.stack([rng.permutation(3)[:2] for _ in range(t)]).astype(np.int32)
    wts = rng.random((t, 2)).astype(np.float32)
    a = htp.moe_ffn(xe, gate, up, down, ids, wts, act=act, backend=host, formats=formats)
    b = htp.moe_ffn(xe, gate, up, down, ids, wts, act=act, backend=hexagon, formats=formats)
    assert _same(a, b) and np.isfinite(b).all()
    if act == "f32":
        tokens = np.repeat(np.arange(t, dtype=np.int32), 2)
        ref = T.ref_expert_op(
            xe, tokens, ids.reshape(-1), wts.reshape(-1), gate, up, down, 256, formats=formats
        )
        assert T.rel_l2(b, ref) < 1e-5


def test_expert_op_routes_past_capacity_and_scattered_slots(
    host: htp.Backend, hexagon: htp.Backend
) -> None:
    """More routes than capacity (split passes), an unrouted non-resident expert, slots out of
    order in planes with padded strides — the arena's layout, in shared memory."""
    rng = np.random.default_rng(11)
    d, ff, n_e, t, k = 64, 64, 6, 7, 2
    gate, up, down = T.random_experts(rng, n_e, d, ff)
    x = rng.standard_normal((t, d)).astype(np.float32)
    ids = np.stack([rng.choice([0, 2, 3, 5], k, replace=False) for _ in range(t)]).astype(np.int32)
    wts = rng.random((t, k)).astype(np.float32)
    tokens = np.repeat(np.arange(t, dtype=np.int32), k)
    slot_of = np.array([3, -1, 0, 4, -1, 1], np.int32)  # experts 1 and 4 not resident
    outs = []
    for be in (host, hexagon):
        planes = []
        for p in (gate, up, down):
            stride = -(-p.shape[1] // 4096) * 4096  # slots 4 KiB apart, as in the arena
            plane = (
                be.empty((5, stride), np.uint8)
                if be.kind != "host"
                else np.zeros((5, stride), np.uint8)
            )
            plane[...] = 0xEE
            for e, s in enumerate(slot_of):
                if s >= 0:
                    plane[s, : p.shape[1]] = p[e]
            planes.append(plane)
        y = be.empty((t, d), np.float32) if be.kind != "host" else np.zeros((t, d), np.float32)
        y[...] = 0.5  # the op accumulates
        with htp.ExpertGraph(d, ff, capacity=3, t_max=t, backend=be) as g:
            g.run(
                x, tokens, np.ascontiguousarray(ids.reshape(-1)),
                np.ascontiguousarray(wts.reshape(-1)), slot_of,
                [p.ctypes.data for p in planes], [p.strides[0] for p in planes], y, act="q8",
            )  # fmt: skip
        outs.append(np.array(y))
    assert _same(outs[0], outs[1]) and not np.allclose(outs[1], 0.5)


@settings(max_examples=2 * _X)
@given(
    t=st.integers(1, 9),
    glu=st.sampled_from(["reglu", "swiglu_oai", "swiglu"]),
    with_bias=st.booleans(),
    act=st.sampled_from(["q8", "f32"]),
    seed=st.integers(0, 2**16),
)
def test_expert_op_glu_kinds_and_biases_bit_exact(
    host: htp.Backend,
    hexagon: htp.Backend,
    t: int,
    glu: str,
    with_bias: bool,
    act: str,
    seed: int,
) -> None:
    """ReGLU and SwiGLU-OAI experts (SwiGLU too), with and without their f32 biases (large
    enough to reach SwiGLU-OAI's clamps): the executor gives the host's bits, and with f32
    products the float64 reference within 1e-5."""
    rng = np.random.default_rng(seed)
    n_e, d, ff, k = 3, 64, 96, 2
    gate, up, down = T.random_experts(rng, n_e, d, ff)
    bias = None
    if with_bias:
        bias = tuple(
            (4.0 * rng.standard_normal(s)).astype(np.float32)
            for s in ((n_e, ff), (n_e, ff), (n_e, d))
        )
    x = (3.0 * rng.standard_normal((t, d))).astype(np.float32)
    ids = np.stack([rng.permutation(n_e)[:k] for _ in range(t)]).astype(np.int32)
    wts = rng.random((t, k)).astype(np.float32)
    kw = dict(act=act, glu=glu, biases=bias)
    a = htp.moe_ffn(x, gate, up, down, ids, wts, backend=host, **kw)
    b = htp.moe_ffn(x, gate, up, down, ids, wts, backend=hexagon, **kw)
    assert _same(a, b) and np.isfinite(b).all()
    if act == "f32":
        tokens = np.repeat(np.arange(t, dtype=np.int32), k)
        ref = T.ref_expert_op(
            x, tokens, ids.reshape(-1), wts.reshape(-1), gate, up, down, ff, glu=glu, biases=bias
        )
        assert T.rel_l2(b, ref) < 1e-5


def test_small_ops(host: htp.Backend, hexagon: htp.Backend) -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((13, 96)).astype(np.float32)
    w = rng.standard_normal(96).astype(np.float32)
    q = rng.standard_normal((37, 4, 32)).astype(np.float32)
    kv = rng.standard_normal((37, 2, 32)).astype(np.float32)
    table32 = rng.standard_normal((50, 64)).astype(np.float32)
    ids = rng.integers(0, 50, 9).astype(np.int32)
    a, b = host, hexagon

    def both(fn, *args, **kw):  # type: ignore[no-untyped-def]
        return fn(*args, backend=a, **kw), fn(*args, backend=b, **kw)

    ra, rb = both(htp.rms_norm, x, w, 1e-5, out=_nan(x.shape))
    assert _same(ra, rb)
    assert T.rel_l2(rb, T.ref_rms_norm(x, w, 1e-5)) < 1e-6
    ra, rb = both(htp.rms_norm_heads, x, w[:32], 3, 1e-6)
    assert _same(ra, rb)
    ra, rb = both(htp.attention, q, kv, kv, 0.17, out=_nan((37, 4, 32)))
    assert _same(ra, rb)
    assert T.rel_l2(rb, T.ref_attention(q, kv, kv, 0.17, True)) < 1e-5
    ra, rb = both(htp.attention, q, kv, kv, 0.3, causal=False)
    assert _same(ra, rb)
    wm = rng.standard_normal((96, 23)).astype(np.float32)
    ra, rb = both(htp.matmul_f32, x, wm, out=_nan((13, 23)))
    assert _same(ra, rb)
    assert T.rel_l2(rb, x.astype(np.float64) @ wm) < 1e-6
    ra, rb = both(htp.silu, x, out=_nan(x.shape))
    assert _same(ra, rb)
    ra, rb = both(htp.swiglu, x, x[::-1].copy(), out=_nan(x.shape))
    assert _same(ra, rb)
    hist = np.ascontiguousarray(x[:3, :32])
    cw = np.ascontiguousarray(q[:4, 0, :].T)  # [32 channels, 4 taps]
    xc = np.ascontiguousarray(x[:, :32])
    ra, rb = both(htp.conv1d_causal, xc, cw, hist, out=_nan(xc.shape))
    assert _same(ra, rb)
    assert T.rel_l2(rb, T.ref_conv1d_causal(xc, cw, hist)) < 1e-6
    for fmt, tab in (
        ("f32", table32),
        ("f16", table32.astype(np.float16)),
        ("q4_0-t32r4", htp.pack_q4_0_t32r4(table32)),
        ("q8_0-t32r4", htp.pack_q8_0_t32r4(table32)),
    ):
        ra, rb = both(htp.get_rows, tab, fmt, 50, 64, ids)
        assert _same(ra, rb) and np.isfinite(rb).all()
    krng = np.random.default_rng(17)
    for fmt, tab in (
        ("q4_k-t32r4", T.pack_q4_k_t32r4(T.random_q4_k_blocks(krng, 50, 256))),
        ("q6_k-t32r4", T.pack_q6_k_t32r4(T.random_q6_k_blocks(krng, 50, 256))),
        ("q5_k-t32r4", T.pack_q5_k_t32r4(T.random_q5_k_blocks(krng, 50, 256))),
        ("mxfp4-t32r4", T.pack_mxfp4_t32r4(T.random_mxfp4_blocks(krng, 50, 256))),
        ("iq4_nl-t32r4", T.pack_iq4_nl_t32r4(T.random_iq4_nl_blocks(krng, 50, 256))),
        ("iq4_xs-t32r4", T.pack_iq4_xs_t32r4(T.random_iq4_xs_blocks(krng, 50, 256))),
    ):
        ra, rb = both(htp.get_rows, tab, fmt, 50, 256, ids)
        assert _same(ra, rb) and np.isfinite(rb).all()
    htp.nop(backend=b)


def _rel_max(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b) / np.maximum(np.abs(b), 1e-30)))


def test_glue_ops_bit_exact(host: htp.Backend, hexagon: htp.Backend) -> None:
    """The ops of the full-accelerator pass: add/mul on row-strided views, copy_rows with a
    broadcast, fill, attention of a segment continuing a context (f32, bf16 and bf16-pv
    products)."""
    rng = np.random.default_rng(17)
    base = rng.standard_normal((11, 77)).astype(np.float32)
    q = rng.standard_normal((13, 4, 24)).astype(np.float32)
    kv = rng.standard_normal((13 + 37, 2, 24)).astype(np.float32)
    outs = []
    for be in (host, hexagon):
        x = be.share(base) if be.kind != "host" else base
        r = []
        for fn in (htp.add, htp.mul):
            o = be.empty((11, 77), np.float32) if be.kind != "host" else _nan((11, 77))
            o[...] = np.nan
            fn(x[:, :25], x[:, 50:75], o[:, 3:28], backend=be)
            r.append(np.array(o))
        d = be.empty((33, 30), np.float32) if be.kind != "host" else _nan((33, 30))
        d[...] = np.nan
        htp.copy_rows(x[:, 40:69], d[:, 1:], 3, backend=be)
        r.append(np.array(d))
        f = be.empty(1000, np.float32) if be.kind != "host" else _nan((1000,))
        f[...] = np.nan
        htp.fill(f[1:-1], 3.25, backend=be)
        r.append(np.array(f))
        qq, kk = (be.share(a) for a in (q, kv)) if be.kind != "host" else (q, kv)
        for products in ("f32", "bf16", "bf16-pv"):
            o = be.empty((13, 4, 24), np.float32) if be.kind != "host" else _nan((13, 4, 24))
            o[...] = np.nan
            htp.attention(qq, kk, kk, 0.3, True, o, products=products, context=37, backend=be)
            r.append(np.array(o))
        outs.append(r)
    for a, b in zip(*outs, strict=True):
        assert _same(a, b)
    ref = base[:, :25].astype(np.float64) + base[:, 50:75]
    assert np.array_equal(outs[1][0][:, 3:28], ref.astype(np.float32))
    assert np.isnan(outs[1][0][:, :3]).all() and np.isnan(outs[1][0][:, 28:]).all()
    assert np.array_equal(outs[1][2][:, 1:], np.repeat(base[:, 40:69], 3, axis=0))
    assert (outs[1][3][1:-1] == 3.25).all() and np.isnan(outs[1][3][[0, -1]]).all()
    ref_att = T.ref_attention(q, kv, kv, 0.3, True, context=37)
    assert T.rel_l2(outs[1][4], ref_att) < 1e-5 and T.rel_l2(outs[1][5], ref_att) < 1e-2
    assert T.rel_l2(outs[1][6], ref_att) < 5e-3


@pytest.mark.parametrize("fmt", ["q4_0-t32r4", "q8_0-t32r4"])
def test_q4_0_q8_0_gemm_bit_exact_with_the_hosts_simd_tables(
    hexagon: htp.Backend, fmt: str
) -> None:
    """Q4_0 / Q8_0 tiles under int8 activations: the DSP process's GEMM (HVX's vrmpy kernels or
    the portable body) gives the bits of the host's best SIMD table (its hand-written fused
    multiply-add epilogue) as well as of the portable body."""
    rng = np.random.default_rng(29)
    n, k, t = 45, 256, 7
    w = rng.standard_normal((n, k)).astype(np.float32)
    buf = htp.pack_q4_0_t32r4(w) if fmt == "q4_0-t32r4" else htp.pack_q8_0_t32r4(w)
    x = rng.standard_normal((t, k)).astype(np.float32)
    got = htp.gemm(hexagon.share(x), hexagon.share(buf), n, fmt, act="q8", backend=hexagon)
    for kw in ({"n_threads": 2}, {"n_threads": 1, "simd": "portable"}):
        with htp.Backend("host", **kw) as be:  # type: ignore[arg-type]
            assert _same(np.array(got), htp.gemm(x, buf, n, fmt, act="q8", backend=be)), kw


@pytest.mark.parametrize("dims", [(64, 64), (20, 24)])
def test_attention_and_swiglu_bit_exact_with_the_hosts_simd_tables(
    hexagon: htp.Backend, dims: tuple[int, int]
) -> None:
    """Attention (fp32, bf16 and bf16-pv products; two query blocks, a context, a sliding
    window, sinks)
    and SiLU/SwiGLU/SwiGLU-OAI in the DSP process give the bits of the host's every kernel table — its
    best SIMD level with two threads (AVX-512's register-blocked and AVX512_BF16 kernels where
    the CPU has them) as well as portable and AVX2: one sequence of fp32 operations (fused
    multiply-adds, exp, the 16-lane row sums) on every table."""
    dk, dv = dims
    rng = np.random.default_rng(23)
    q = rng.standard_normal((70, 4, dk)).astype(np.float32)
    kv = rng.standard_normal((70 + 9, 2, dk + dv)).astype(np.float32)
    k, v = np.ascontiguousarray(kv[..., :dk]), np.ascontiguousarray(kv[..., dk:])
    sinks = (2 * rng.standard_normal(4)).astype(np.float32)
    g = (5 * rng.standard_normal((7, 75))).astype(np.float32)
    u = rng.standard_normal((7, 75)).astype(np.float32)
    cases = [
        ({"products": products, **extra}, ctx)
        for products in ("f32", "bf16", "bf16-pv")
        for extra, ctx in (({}, 0), ({"window": 40, "sinks": sinks}, 9))
    ]

    def run(be: htp.Backend) -> list[np.ndarray]:
        sh = (lambda a: be.share(a)) if be.kind != "host" else (lambda a: a)
        r = []
        for kw, ctx in cases:
            kk, vv = sh(k[9 - ctx :]), sh(v[9 - ctx :])
            kw = {**kw, "sinks": sh(kw["sinks"])} if "sinks" in kw else kw
            r.append(
                np.array(htp.attention(sh(q), kk, vv, 0.125, True, context=ctx, backend=be, **kw))
            )
        r.append(np.array(htp.silu(sh(g), backend=be)))
        r.append(np.array(htp.swiglu(sh(g), sh(u), backend=be)))
        r.append(np.array(htp.swiglu_oai(sh(g), sh(u), 1.702, 1.5, backend=be)))  # clamps reached
        return r

    got = run(hexagon)
    levels = [None, "portable"] + (["avx2"] if htp.simd_supported("avx2") else [])
    for level in levels:
        kw = {"n_threads": 2} if level is None else {"n_threads": 1, "simd": level}
        with htp.Backend("host", **kw) as be:  # type: ignore[arg-type]
            want = run(be)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert _same(a, b), (level, i)
    ref = T.ref_attention(q, k[9:], v[9:], 0.125, True)
    assert T.rel_l2(got[0], ref) < 1e-5 and T.rel_l2(got[2], ref) < 1e-2
    assert T.rel_l2(got[4], ref) < 5e-3


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("yarn", [False, True])
def test_rope_within_1e6_of_host(
    host: htp.Backend, hexagon: htp.Backend, mode: str, yarn: bool
) -> None:
    """cos/sin/pow come from the runtime's libm, not the host's: the float results may differ
    by a rounding, never more than 1e-6 relative (on entries not near zero)."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((29, 3, 48)).astype(np.float32)
    pos = (np.arange(29, dtype=np.int32) * 37) % 1000
    kw: dict[str, object] = {}
    if yarn:
        kw = dict(ext_factor=1.0, attn_factor=1.0, corr_dims=htp.rope_yarn_corr_dims(32, 4096, 1e6))
    outs = []
    for be in (host, hexagon):
        y = q.copy()
        htp.rope(
            y, pos, 32, 1e6 if yarn else 10000.0, 0.25 if yarn else 1.0, mode, backend=be, **kw
        )  # type: ignore[arg-type]
        outs.append(y)
    big = np.abs(outs[0]) > 1e-3
    assert _rel_max(outs[1][big], outs[0][big]) <= 1e-6
    assert np.max(np.abs(outs[1] - outs[0])) <= 1e-6 * np.max(np.abs(outs[0]))
    assert not _same(outs[1], q)


@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
def test_router_within_1e6_of_host(host: htp.Backend, hexagon: htp.Backend, gating: str) -> None:
    rng = np.random.default_rng(5)
    logits = (3 * rng.standard_normal((17, 12))).astype(np.float32)
    bias = rng.standard_normal(12).astype(np.float32) if gating == "sigmoid" else None
    ia, wa = htp.router_topk(logits, 4, gating, True, 2.5, bias, backend=host)  # type: ignore[arg-type]
    ib, wb = htp.router_topk(logits, 4, gating, True, 2.5, bias, backend=hexagon)  # type: ignore[arg-type]
    assert _same(ia, ib)
    assert _rel_max(wb, wa) <= 1e-6


def test_missing_tools_and_executor_are_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ESTREAM_HTP_QEMU_HEXAGON", "qemu-hexagon-not-installed")
    with pytest.raises(htp.HTPUnsupportedError, match="qemu-hexagon-not-installed"):
        htp.Backend("hexagon")
    monkeypatch.delenv("ESTREAM_HTP_QEMU_HEXAGON")
    monkeypatch.setenv("ESTREAM_HTP_HEXAGON_EXECUTOR", "/nonexistent/htp_executor")
    with pytest.raises(htp.HTPUnsupportedError, match="no such file"):
        htp.Backend("hexagon")


def test_a_program_that_is_not_the_executor_is_refused(tmp_path) -> None:
    """An executor command that exits at once: the backend fails at start, nothing is left."""
    import sys

    with pytest.raises(htp.HTPError):
        htp.Backend("hexagon", executor=[sys.executable, "-c", "pass"])


def test_more_than_one_thread_is_refused() -> None:
    with pytest.raises(htp.HTPInputError, match="one thread"):
        htp.Backend("hexagon", n_threads=2)
    with htp.Backend("hexagon") as b, pytest.raises(htp.HTPUnsupportedError):
        b.configure(n_threads=2)


# ---------------------------------------------------------------------- the runtime's arithmetic
def _ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Distance in units in the last place (doubles)."""
    lo = np.int64(-(2**63))
    g, w = got.view(np.int64), want.view(np.int64)
    g = np.where(g < 0, lo - g, g)  # sign-magnitude -> a monotone integer line (exact in int64)
    w = np.where(w < 0, lo - w, w)
    return np.abs(g - w)


def test_runtime_arithmetic_against_host_ieee_and_libm(tmp_path) -> None:
    """csrc/hexagon/hx_math.c and the compiler's inline division, under qemu-hexagon: double
    division, square root, floor/ceil, float division and nearbyintf exact (IEEE round to
    nearest even, as the host's hardware); exp/log within 2 double ulp of glibc, sin/cos within
    4 ulp of max(|result|, 1e-3), pow within 2 + 4|y ln x| ulp; integer division exact."""
    import subprocess
    from pathlib import Path

    from estream_htp import _hexagon
    from estream_htp import _hexagon_build as hb

    pkg = Path(__file__).resolve().parents[1]
    if not (pkg / "tools" / "hexagon_selftest.c").is_file():
        pytest.skip("needs the source tree")
    miss = hb.missing_tools(("clang", "lld"))
    if miss and os.environ.get("ESTREAM_HTP_REQUIRE_HEXAGON", "").strip() != "1":
        pytest.skip(f"building the self-test needs {', '.join(miss)}")
    exe = tmp_path / "selftest"
    hb.build_program(
        pkg, [pkg / "tools" / "hexagon_selftest.c", *(pkg / "csrc" / r for r in hb.RUNTIME)], exe
    )
    rng = np.random.default_rng(8)
    n = 4000
    a = rng.standard_normal(n) * 10.0 ** rng.uniform(-300, 300, n)
    b = rng.standard_normal(n) * 10.0 ** rng.uniform(-300, 300, n)
    a[:6] = [1.0, 3.0, 2.5, -7.0, 1e-310, 5e-324]  # exact cases and subnormals
    b[:6] = [3.0, 1.0, 0.5, 2.0, 3.0, 1.0]
    a[6:40] = rng.uniform(-1e6, 1e6, 34)
    b[6:40] = rng.uniform(1e-320, 1e-300, 34)  # subnormal divisors
    c = np.concatenate([rng.uniform(-30, 30, n // 2), rng.uniform(-2e4, 2e4, n - n // 2)])
    c[:8] = [0.0, -0.0, 0.5, 1.5, 2.5, -2.5, 700.0, -740.0]
    i = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64)
    j = rng.integers(-(2**40), 2**40, n, dtype=np.int64)
    j[n // 2 :] = rng.integers(-1000, 1000, n - n // 2)
    j[j == 0] = 7
    stdin = np.uint32(n).tobytes() + b"".join(v.tobytes() for v in (a, b, c, i, j))
    r = subprocess.run(
        [hb.tool("qemu"), "-cpu", _hexagon.QEMU_CPU, str(exe)], input=stdin, capture_output=True,
        timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = r.stdout
    d = np.frombuffer(out[: 9 * 8 * n], np.float64).reshape(9, n)
    f = np.frombuffer(out[9 * 8 * n : 9 * 8 * n + 2 * 4 * n], np.float32).reshape(2, n)
    q = np.frombuffer(out[9 * 8 * n + 2 * 4 * n :], np.int64).reshape(8, n)
    with np.errstate(all="ignore"):
        assert np.array_equal(d[0], a / b, equal_nan=True)
        assert np.array_equal(d[1], np.sqrt(np.abs(a)))
        assert np.array_equal(d[7], np.floor(a)) and np.array_equal(d[8], np.ceil(a))
        assert np.array_equal(f[0], a.astype(np.float32) / b.astype(np.float32), equal_nan=True)
        assert np.array_equal(f[1], np.rint(c.astype(np.float32)))
        assert _ulps(d[2], np.exp(c)).max() <= 2
        assert _ulps(d[3], np.log(np.abs(a))).max() <= 2
        # pow = exp(y log x): the rounding of y log x costs about |y ln x| ulp (RoPE's
        # freq_base^(-2j/n_rot): |y ln x| <= 14)
        pw = np.power(np.abs(a), c / 100.0)
        ok = np.isfinite(pw) & (pw != 0)
        bound = 2 + 4 * np.abs(c / 100.0 * np.log(np.abs(a)))
        assert not (ok & (_ulps(d[6], pw) > bound)).any()
        for got, want in ((d[4], np.sin(c)), (d[5], np.cos(c))):
            err = np.abs(got - want) / np.maximum(np.abs(want), 1e-3)
            assert err.max() <= 4 * 2.0**-52, err.max()
    u, v = i.view(np.uint64), j.view(np.uint64)
    assert np.array_equal(q[0].view(np.uint64), u // v) and np.array_equal(
        q[1].view(np.uint64), u % v
    )
    sq = np.array(
        [abs(int(x)) // abs(int(y)) * (1 if (x < 0) == (y < 0) else -1) for x, y in zip(i, j)]
    )
    assert np.array_equal(q[2], sq) and np.array_equal(q[3], i - sq * j)  # C: truncation
    u3, v3 = (u & 0xFFFFFFFF), (v & 0xFFFFFFFF)
    v3 = np.where(v3 == 0, 1, v3)
    assert np.array_equal(q[4].view(np.uint64), u3 // v3) and np.array_equal(
        q[5].view(np.uint64), u3 % v3
    )
    s3, t3 = (
        u3.astype(np.uint32).view(np.int32).astype(np.int64),
        v3.astype(np.uint32).view(np.int32).astype(np.int64),
    )
    tq = np.array([abs(x) // abs(y) * (1 if (x < 0) == (y < 0) else -1) for x, y in zip(s3, t3)])
    assert np.array_equal(q[6], tq) and np.array_equal(q[7], s3 - tq * t3)


# A store and then a load of the same address in one packet: what clang emitted for the
# runtime's nearbyintf when it kept its sum in a volatile stack slot. The load must see the
# store, and qemu-hexagon 7.2 now and then answered it with the slot's old bytes (the first exp
# of an op came out wrong).
_STORE = re.compile(r"\bv?mem\w*\((r\d+)(?:\s*\+\s*#(-?(?:0x)?[0-9a-f]+))?\)(?::\w+)?\s*=")
_LOAD = re.compile(r"=\s*v?mem\w*\((r\d+)(?:\s*\+\s*#(-?(?:0x)?[0-9a-f]+))?\)")


def store_then_load_packets(disassembly: str) -> list[str]:
    """The packets of an ``llvm-objdump -d`` listing that store to an address and then (later
    in the packet) load from the same base register and offset."""
    found = []
    for packet in re.findall(r"\{(.*?)\}", disassembly, re.S):
        stored: set[tuple[str, int]] = set()
        for insn in re.split(r"\n|;", packet):
            for m in _LOAD.finditer(insn):
                if (m.group(1), int(m.group(2) or "0", 0)) in stored:
                    found.append(" ".join(packet.split()))
            for m in _STORE.finditer(insn):
                stored.add((m.group(1), int(m.group(2) or "0", 0)))
    return found


def test_store_then_load_packets_are_found() -> None:
    listing = """
   44e98: { \tmemw(r29+#0x4) = r1
   44e9c:   \tr1 = memw(r29+#0x4) }
   26e4c: { \tr0 = memw(r29+#0x14); \tmemw(r29+#0x14) = r4 }
   30000: { \tmemd(r30+#-0x10) = r17:16
   30004:   \tr2 = memw(r30+#-0x8) }
"""
    assert store_then_load_packets(listing) == ["memw(r29+#0x4) = r1 44e9c: r1 = memw(r29+#0x4)"]


def test_no_packet_of_the_executor_reloads_what_it_stores() -> None:
    """No packet of the executor program stores to an address and then loads from it (see
    `store_then_load_packets`): the emulator the backend runs under mishandles such packets."""
    from estream_htp import _hexagon

    objdump = shutil.which("llvm-objdump-19") or shutil.which("llvm-objdump")
    if objdump is None:
        assert os.environ.get("ESTREAM_HTP_REQUIRE_HEXAGON", "").strip() != "1", "no llvm-objdump"
        pytest.skip("llvm-objdump-19 not installed (apt-get install llvm-19)")
    listing = subprocess.run(
        [objdump, "-d", "--no-show-raw-insn", str(_hexagon.executor_path())],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert listing.count("{") > 1000  # a Hexagon listing of the whole program
    assert store_then_load_packets(listing) == []


@pytest.mark.parametrize(
    "fmt",
    ["q4_k-t32r4", "q5_k-t32r4", "q6_k-t32r4", "iq4_nl-t32r4", "iq4_xs-t32r4", "q4_1-t32r4",
     "q5_0-t32r4", "q5_1-t32r4", "mxfp4-t32r4"],
)  # fmt: skip
def test_hvx_table_runs_its_own_kernels(fmt: str) -> None:
    """The `hvx` table multiplies tiles of every format beside Q4_0 and Q8_0 with its own HVX
    kernel (htp_hvx_q4kq8_strip, nlq8_strip_hvx, ...) and never the portable one, and the
    `portable` table the reverse: counted from QEMU's execution log of one GEMM
    (tools/hexagon_packets.py), which the bit-exact tests above cannot tell apart."""
    import importlib.util
    from pathlib import Path

    from estream_htp import _hexagon

    if shutil.which("llvm-nm-19") is None:
        assert os.environ.get("ESTREAM_HTP_REQUIRE_HEXAGON", "").strip() != "1", "no llvm-nm-19"
        pytest.skip("llvm-nm-19 not installed (apt-get install llvm-19)")
    tool = Path(__file__).resolve().parents[1] / "tools" / "hexagon_packets.py"
    spec = importlib.util.spec_from_file_location("hexagon_packets", tool)
    assert spec and spec.loader
    pk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pk)
    exe = _hexagon.executor_path()
    hvx, portable = (pk._symbol_range(exe, f) for f in pk.KERNELS[fmt])
    assert pk.measure(exe, *hvx, 8, 3, "hvx", fmt) > 0
    assert pk.measure(exe, *portable, 8, 3, "hvx", fmt) == 0
    assert pk.measure(exe, *portable, 8, 3, "portable", fmt) > 0
    assert pk.measure(exe, *hvx, 8, 3, "portable", fmt) == 0
