"""The ops that let a whole forward pass run on an executor ("full accelerator"): element-wise
add / multiply over row-strided views, the strided row copy (slices, re-orderings,
broadcasts), fill, and attention of a segment continuing a context (with sliding windows and
sinks).

Each against float64 references on awkward shapes with NaN-poisoned outputs, on every backend
kind (host, host-process, hexagon under qemu); bytes outside what an op should write are
checked untouched. Add and multiply round once per element, so they equal the float64 result
rounded to float32 exactly."""

from __future__ import annotations

import time

import numpy as np
import pytest
from helpers import KINDS, REMOTE_KINDS, SIMD_PARAMS, mode
from hypothesis import given, settings
from hypothesis import strategies as st

import estream_htp as htp
from estream_htp import testing as T


@pytest.fixture(scope="module", params=KINDS)
def be(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    kind = request.param
    n = 1 if kind == "hexagon" else 2
    with htp.Backend(kind, n_threads=n) as b:
        yield b


def _arr(be: htp.Backend, shape: tuple[int, ...], fill: float = np.nan) -> np.ndarray:
    """An array the backend reads in place (shared memory for an executor), pre-filled."""
    a = be.empty(shape, np.float32) if be.kind != "host" else np.empty(shape, np.float32)
    a[...] = fill
    return a


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 19),
    cols=st.integers(1, 37),
    pad=st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(0, 5)),
    op=st.sampled_from(["add", "mul"]),
    seed=st.integers(0, 2**16),
)
def test_add_mul_strided_rows_exact(be, rows, cols, pad, op, seed) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    # a, b, out: column windows of wider rows (x[:, off:off+cols]), shared when remote
    bases = [_arr(be, (rows, cols + p + 3)) for p in pad]
    for base in bases[:2]:
        base[...] = rng.standard_normal(base.shape).astype(np.float32) * 10
    a, b, o = (base[:, 2 : 2 + cols] for base in bases)
    before = np.array(bases[2])
    fn = htp.add if op == "add" else htp.mul
    y = fn(a, b, o, backend=be)
    ref = (
        a.astype(np.float64) + b.astype(np.float64)
        if op == "add"
        else a.astype(np.float64) * b.astype(np.float64)
    )
    assert y is o and np.array_equal(o, ref.astype(np.float32))
    outside = np.ones(bases[2].shape, bool)
    outside[:, 2 : 2 + cols] = False
    assert np.isnan(bases[2][outside]).all() and np.isnan(before[outside]).all()


@pytest.mark.parametrize("shape", [(1,), (7,), (5, 3, 11), (129, 33)])
def test_add_mul_contiguous_and_in_place(be, shape) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(len(shape))
    a = _arr(be, shape)
    b = _arr(be, shape)
    a[...] = rng.standard_normal(shape)
    b[...] = rng.standard_normal(shape)
    a0 = np.array(a)
    out = _arr(be, shape)
    assert np.array_equal(htp.mul(a, b, out, backend=be), (a0 * b).astype(np.float32))
    htp.add(a, b, a, backend=be)  # in place
    assert np.array_equal(a, (a0.astype(np.float64) + b).astype(np.float32))


@pytest.mark.parametrize("op", ["add", "mul"])
def test_add_mul_large_rows_exact_in_place_and_overlapping(be, op) -> None:  # type: ignore[no-untyped-def]
    """Enough elements for the rows to be split across the backend's threads (>= 64K): column
    windows of wider rows equal the float64 result rounded once; in place (out is a) the same;
    an out that overlaps an input otherwise (one row off) is refused."""
    rng = np.random.default_rng(21)
    rows, cols = 517, 301  # 155,617 elements
    fn = htp.add if op == "add" else htp.mul
    f64 = (lambda x, y: x + y) if op == "add" else (lambda x, y: x * y)
    bases = [_arr(be, (rows, cols + 5)) for _ in range(3)]
    for base in bases[:2]:
        base[...] = rng.standard_normal(base.shape).astype(np.float32) * 10
    a, b, o = (base[:, 2 : 2 + cols] for base in bases)
    want = f64(a.astype(np.float64), b.astype(np.float64)).astype(np.float32)
    assert fn(a, b, o, backend=be) is o and np.array_equal(o, want)
    assert np.isnan(bases[2][:, :2]).all() and np.isnan(bases[2][:, 2 + cols :]).all()
    a0 = np.array(a)
    fn(a, b, a, backend=be)  # in place
    assert np.array_equal(a, want) and not np.array_equal(a, a0)
    # out one row before / after a, in the same buffer: refused (rows split across threads
    # would give an order-dependent result), and nothing written
    buf = _arr(be, (rows + 1, cols))
    buf[...] = rng.standard_normal(buf.shape).astype(np.float32)
    before = np.array(buf)
    for src, dst in ((buf[1:], buf[:-1]), (buf[:-1], buf[1:])):
        with pytest.raises(htp.HTPInputError, match="rejected an argument"):
            fn(src, b, dst, backend=be)
        with pytest.raises(htp.HTPInputError, match="rejected an argument"):
            fn(b, src, dst, backend=be)
    assert np.array_equal(buf, before)


@pytest.mark.parametrize("op", ["silu", "swiglu"])
def test_silu_swiglu_large_split_in_place_and_overlapping(be, op) -> None:  # type: ignore[no-untyped-def]
    """Enough values for the backend's threads to split them (>= 64K, not a multiple of the
    vector width): every element has the bits of the same op on a short piece (one thread),
    and is float64's silu(g)·u within rounding; in place (out is g) the same; an out that
    overlaps an input otherwise (one element off) is refused, nothing written."""
    rng = np.random.default_rng(23)
    n = 200_003
    g = _arr(be, (n,))
    u = _arr(be, (n,))
    g[...] = (rng.standard_normal(n) * 4).astype(np.float32)
    u[...] = rng.standard_normal(n).astype(np.float32)
    fn = (
        (lambda a, out: htp.silu(a, out, backend=be))
        if op == "silu"
        else (lambda a, out: htp.swiglu(a, u[: a.size], out, backend=be))
    )
    o = _arr(be, (n,))
    assert fn(g, o) is o
    g64 = g.astype(np.float64)
    ref = g64 / (1 + np.exp(-g64)) * (1.0 if op == "silu" else u.astype(np.float64))
    assert np.abs(o - ref).max() <= 1e-5 * np.abs(ref).max()
    for lo, hi in ((0, 1000), (99_971, 100_500), (n - 777, n)):  # short pieces: one thread
        if op == "silu":
            piece = htp.silu(np.array(g[lo:hi]), backend=be)
        else:
            piece = htp.swiglu(np.array(g[lo:hi]), np.array(u[lo:hi]), backend=be)
        assert piece.tobytes() == o[lo:hi].tobytes()
    want = np.array(o)
    fn(g, g)  # in place
    assert g.tobytes() == want.tobytes()
    buf = _arr(be, (n + 1,))
    buf[...] = rng.standard_normal(n + 1).astype(np.float32)
    before = np.array(buf)
    for src, dst in ((buf[1:], buf[:-1]), (buf[:-1], buf[1:])):
        with pytest.raises(htp.HTPInputError, match="rejected an argument"):
            fn(src, dst)
    if op == "swiglu":  # the up operand overlapping out is refused the same way
        with pytest.raises(htp.HTPInputError, match="rejected an argument"):
            htp.swiglu(np.array(g[:n]), buf[1:], buf[:-1], backend=be)
    assert np.array_equal(buf, before)


def test_copy_rows_large_broadcast_exact(be) -> None:  # type: ignore[no-untyped-def]
    """A copy big enough for the backend's threads: every row of dst is its source row."""
    rng = np.random.default_rng(22)
    rows, cols, rep = 301, 219, 3  # 197,757 destination elements
    src_base = _arr(be, (rows, cols + 4))
    src_base[...] = rng.standard_normal(src_base.shape)
    dst_base = _arr(be, (rows * rep, cols + 2))
    src, dst = src_base[:, 3 : 3 + cols], dst_base[:, 1 : 1 + cols]
    assert htp.copy_rows(src, dst, rep, backend=be) is dst
    assert np.array_equal(dst, np.repeat(np.asarray(src, np.float64), rep, axis=0))
    assert np.isnan(dst_base[:, 0]).all() and np.isnan(dst_base[:, 1 + cols :]).all()


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 13),
    cols=st.integers(1, 29),
    rep=st.integers(1, 5),
    off=st.integers(0, 4),
    seed=st.integers(0, 2**16),
)
def test_copy_rows_slices_and_broadcasts(be, rows, cols, rep, off, seed) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    src_base = _arr(be, (rows, cols + off + 2))
    src_base[...] = rng.standard_normal(src_base.shape)
    dst_base = _arr(be, (rows * rep, cols + 3))
    src = src_base[:, off : off + cols]
    dst = dst_base[:, 1 : 1 + cols]
    assert htp.copy_rows(src, dst, rep, backend=be) is dst
    assert np.array_equal(dst, np.repeat(np.asarray(src, np.float64), rep, axis=0))
    assert np.isnan(dst_base[:, 0]).all() and np.isnan(dst_base[:, 1 + cols :]).all()


def test_copy_rows_errors(be) -> None:  # type: ignore[no-untyped-def]
    x = _arr(be, (6, 8), 1.0)
    with pytest.raises(htp.HTPInputError, match="rep"):
        htp.copy_rows(x[:3], x[3:], 2, backend=be)
    with pytest.raises(htp.HTPInputError, match="contiguous rows"):
        htp.copy_rows(x[:, ::2], _arr(be, (6, 4)), backend=be)
    with pytest.raises(htp.HTPInputError, match="rejected an argument"):  # overlap, executor-side
        htp.copy_rows(x[:4, :4], x[2:6, 2:6], backend=be)


@pytest.mark.parametrize("n", [1, 31, 1000])
def test_fill(be, n) -> None:  # type: ignore[no-untyped-def]
    base = _arr(be, (n + 2,))
    htp.fill(base[1 : n + 1], -2.5, backend=be)
    assert (base[1 : n + 1] == -2.5).all() and np.isnan(base[[0, n + 1]]).all()
    i = be.empty(n, np.int32) if be.kind != "host" else np.empty(n, np.int32)
    i[...] = 7
    htp.fill(i, -(2**31), backend=be)
    assert (i == -(2**31)).all()
    with pytest.raises(htp.HTPInputError, match="int32"):
        htp.fill(i, 0.5, backend=be)


@settings(max_examples=15, deadline=None)
@given(
    t=st.integers(1, 40),
    ctx=st.integers(0, 70),
    hkv=st.integers(1, 2),
    rep=st.integers(1, 3),
    dk=st.sampled_from([16, 24, 32]),
    dv=st.sampled_from([16, 8]),
    causal=st.booleans(),
    window=st.integers(0, 50),
    with_sinks=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_attention_with_context(
    be, t, ctx, hkv, rep, dk, dv, causal, window, with_sinks, seed
) -> None:  # type: ignore[no-untyped-def]
    """A segment continuing a context, optionally with a sliding window (causal) and per-head
    sinks (a reference of their own), against float64 into a NaN-poisoned output."""
    rng = np.random.default_rng(seed)
    hq = hkv * rep
    window = window if causal else 0
    q = _arr(be, (t, hq, dk))
    k = _arr(be, (ctx + t, hkv, dk))
    v = _arr(be, (ctx + t, hkv, dv))
    sinks = _arr(be, (hq,)) if with_sinks else None
    for a in (q, k, v) if sinks is None else (q, k, v, sinks):
        a[...] = rng.standard_normal(a.shape)
    out = _arr(be, (t, hq, dv))
    y = htp.attention(
        q, k, v, 0.3, causal, out, context=ctx, window=window, sinks=sinks, backend=be
    )
    ref = T.ref_attention(q, k, v, 0.3, causal, context=ctx, window=window, sinks=sinks)
    assert y is out and T.rel_l2(y, ref) <= 1e-5


@pytest.mark.parametrize("level", SIMD_PARAMS)
@pytest.mark.parametrize("products", ["f32", "bf16", "bf16-pv"])
def test_attention_with_context_is_the_full_prefill_rows(level, products) -> None:
    """A continuing segment with its context gives, bit for bit, the rows the causal kernel
    computes for the same queries inside the whole sequence (every host kernel set)."""
    rng = np.random.default_rng(5)
    ctx, t, hq, hkv, d = 45, 70, 4, 2, 32
    q = rng.standard_normal((ctx + t, hq, d)).astype(np.float32)
    k = rng.standard_normal((ctx + t, hkv, d)).astype(np.float32)
    v = rng.standard_normal((ctx + t, hkv, d)).astype(np.float32)
    with mode(simd=level):
        full = htp.attention(q, k, v, 0.2, products=products)
        seg = htp.attention(
            np.ascontiguousarray(q[ctx:]), k, v, 0.2, out=np.full((t, hq, d), np.nan, np.float32),
            products=products, context=ctx,
        )  # fmt: skip
    assert seg.tobytes() == full[ctx:].tobytes()


@pytest.mark.parametrize("level", SIMD_PARAMS)
@pytest.mark.parametrize("products", ["f32", "bf16", "bf16-pv"])
def test_windowed_segment_is_the_full_prefill_rows(level, products) -> None:
    """With a sliding window and sinks too, a continuing segment gives bit for bit the rows
    of the whole sequence, and a window covering every key changes nothing."""
    rng = np.random.default_rng(6)
    ctx, t, hq, hkv, d = 45, 70, 4, 2, 32
    q = rng.standard_normal((ctx + t, hq, d)).astype(np.float32)
    k = rng.standard_normal((ctx + t, hkv, d)).astype(np.float32)
    v = rng.standard_normal((ctx + t, hkv, d)).astype(np.float32)
    sinks = rng.standard_normal(hq).astype(np.float32)
    with mode(simd=level):
        full = htp.attention(q, k, v, 0.2, products=products, window=19, sinks=sinks)
        seg = htp.attention(
            np.ascontiguousarray(q[ctx:]), k, v, 0.2, out=np.full((t, hq, d), np.nan, np.float32),
            products=products, context=ctx, window=19, sinks=sinks,
        )  # fmt: skip
        plain = htp.attention(q, k, v, 0.2, products=products)
        wide = htp.attention(q, k, v, 0.2, products=products, window=ctx + t)
    assert seg.tobytes() == full[ctx:].tobytes()
    assert wide.tobytes() == plain.tobytes()
    assert not np.array_equal(full, plain)


def test_attention_window_and_sinks_checked() -> None:
    q = np.zeros((3, 2, 16), np.float32)
    with pytest.raises(htp.HTPInputError, match="window needs causal"):
        htp.attention(q, q, q, 1.0, causal=False, window=2)
    with pytest.raises(htp.HTPInputError, match="window"):
        htp.attention(q, q, q, 1.0, window=-1)
    with pytest.raises(htp.HTPInputError, match=r"sinks must be \[Hq = 2\]"):
        htp.attention(q, q, q, 1.0, sinks=np.zeros(3, np.float32))
    with pytest.raises(htp.HTPInputError, match="sinks must be finite"):
        htp.attention(q, q, q, 1.0, sinks=np.array([0.0, np.inf], np.float32))


def test_attention_context_shape_checked() -> None:
    q = np.zeros((3, 2, 16), np.float32)
    k = np.zeros((5, 2, 16), np.float32)
    with pytest.raises(htp.HTPInputError, match="context"):
        htp.attention(q, k, k, 1.0, context=1)
    with pytest.raises(htp.HTPInputError, match="context"):
        htp.attention(q, k, k, 1.0)


@pytest.mark.parametrize("kind", REMOTE_KINDS)
def test_op_times_are_in_the_host_clock(kind: str) -> None:
    """Every completion carries the executor's start and end: submitted <= started <=
    completed, all inside the host's perf_counter bracket of the call — the executor's
    CLOCK_MONOTONIC (qemu-user's is the host kernel's) converted to the host's clock."""
    with htp.Backend(kind, n_threads=1) as b:
        x = b.empty((9, 33), np.float32)
        x[...] = 1.0
        b.trace = []
        names = []
        for fn, name in ((htp.add, "add"), (htp.mul, "mul"), (htp.silu, "silu")):
            t0 = time.perf_counter()
            if name == "silu":
                fn(x, b.empty(x.shape, np.float32), backend=b)
            else:
                fn(x, x, b.empty(x.shape, np.float32), backend=b)
            t1 = time.perf_counter()
            names.append(name)
            got, sub, start, end = b.trace[-1]
            assert got == name
            assert t0 <= sub <= start <= end <= t1, (t0, sub, start, end, t1)
        assert [e[0] for e in b.trace] == names
        st = b.stats()
        assert st["ops_submitted"] == st["ops_completed"] == 3 and st["staged_bytes"] == 0
        htp.add(np.ones(10, np.float32), np.ones(10, np.float32), backend=b)  # staged
        assert b.stats()["staged_bytes"] == 3 * 40


def test_view_outside_registered_memory_is_refused_by_executors() -> None:
    with htp.Backend("host-process", n_threads=1) as b:
        x = np.ones((4, 8), np.float32)
        with pytest.raises(htp.HTPInputError, match="not inside memory registered"):
            htp.add(x[:, :4], x[:, 4:], backend=b)
