"""The recurrence: against the discrete-event simulator, hand-derived cases, monotonicity and
lower bounds, broadcasting, and the configurator's bank-sweep fast path."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from estream_sched import Schedule, pipeline_schedule, pipeline_time, simulate
from estream_sched._model import sweep_banks
from estream_sched.testing import PipelineInstance, durations, pipeline_instances


def f_K(inst: PipelineInstance, **over: object) -> float:
    kw = {"L": inst.L, "X": inst.X, "t_ne": inst.t_ne, "q": inst.q, "b": inst.b, **over}
    return float(pipeline_time(kw["L"], kw["X"], kw["t_ne"], kw["q"], kw["b"]))


def test_hand_derived_example() -> None:
    # q = b = 1: reads and executions strictly alternate.
    s = pipeline_schedule([2, 2, 2], [1, 1, 1], 1.0, 1, 1)
    assert s.a.tolist() == [0, 3, 6]
    assert s.d.tolist() == [2, 5, 8]
    assert s.s.tolist() == [2, 5, 8]
    assert s.f.tolist() == [3, 6, 9]
    # b = 2: read 2 overlaps execution 1; read 3 waits for bank 1 (f_1 = 3) and reader (d_2 = 4).
    s = pipeline_schedule([2, 2, 2], [1, 1, 1], 1.0, 1, 2)
    assert s.a.tolist() == [0, 2, 4]
    assert s.f.tolist() == [3, 5, 7]
    # Non-expert work dominates: every group waits for t_ne = 10.
    assert pipeline_time([1, 1], [1, 1], 10.0, 2, 2) == 12.0


@given(pipeline_instances())
def test_recurrence_equals_simulator_exactly(inst: PipelineInstance) -> None:
    rec = pipeline_schedule(inst.L, inst.X, inst.t_ne, inst.q, inst.b)
    sim = simulate(inst.L, inst.X, inst.t_ne, inst.q, inst.b)
    assert rec == sim  # bit-for-bit: same max/plus operations on the same floats


@given(pipeline_instances(profile_shaped=True))
def test_thread_pool_loader_equals_recurrence_on_profile_shaped_reads(
    inst: PipelineInstance,
) -> None:
    rec = pipeline_schedule(inst.L, inst.X, inst.t_ne, inst.q, inst.b)
    sim = simulate(inst.L, inst.X, inst.t_ne, inst.q, inst.b, reader_policy="shared_queue")
    assert rec == sim


@given(pipeline_instances())
def test_time_is_last_finish_of_schedule(inst: PipelineInstance) -> None:
    s = pipeline_schedule(inst.L, inst.X, inst.t_ne, inst.q, inst.b)
    expect = inst.t_ne if inst.K == 0 else s.f[-1]
    assert f_K(inst) == expect == float(s.total)
    if inst.K:
        assert np.all(np.diff(s.f) >= 0) and np.all(s.s >= s.d) and np.all(s.s >= inst.t_ne)
        assert np.all(s.d == s.a + inst.L) and np.all(s.f == s.s + inst.X)


@given(pipeline_instances(), st.integers(1, 8))
def test_non_increasing_in_banks(inst: PipelineInstance, extra: int) -> None:
    assert f_K(inst, b=inst.b + extra) <= f_K(inst)


@given(pipeline_instances(profile_shaped=True, max_q=8, max_b=8))
def test_non_increasing_in_queue_depth_up_to_b(inst: PipelineInstance) -> None:
    times = [f_K(inst, q=q) for q in range(1, inst.b + 1)]
    assert all(x >= y for x, y in itertools.pairwise(times)), times


def test_queue_depth_monotonicity_needs_ordered_completions() -> None:
    # The recurrence pins read k behind read k-q (static round-robin slots). With uneven read
    # times a deeper queue can put two long reads on the same chain: documented in README.
    L = [10, 0, 0, 10, 0, 0, 10]
    assert pipeline_time(L, [0] * 7, 0.0, 2, 100) == 20.0
    assert pipeline_time(L, [0] * 7, 0.0, 3, 100) == 30.0


@given(pipeline_instances(min_groups=1), st.data(), durations())
def test_non_decreasing_in_every_input(
    inst: PipelineInstance, data: st.DataObject, dt: float
) -> None:
    base = f_K(inst)
    k = data.draw(st.integers(0, inst.K - 1))
    L2 = inst.L.copy()
    L2[k] += dt
    X2 = inst.X.copy()
    X2[k] += dt
    assert f_K(inst, L=L2) >= base
    assert f_K(inst, X=X2) >= base
    assert f_K(inst, t_ne=inst.t_ne + dt) >= base


@given(pipeline_instances())
def test_lower_bounds(inst: PipelineInstance) -> None:
    t = f_K(inst)
    assert t >= inst.t_ne
    if inst.K:
        assert t >= inst.t_ne + inst.X[-1]
        assert t >= inst.X.sum() * (1 - 1e-12)
        assert t >= inst.L.sum() / inst.q * (1 - 1e-12)
        assert t >= inst.L[0] + inst.X[-1] * 0  # reads start at 0


def test_empty_candidate_axis() -> None:
    out = pipeline_time(np.zeros((0, 3)), np.zeros((0, 3)), 1.0, 2, 2)
    assert out.shape == (0,)
    assert pipeline_schedule(np.zeros((2, 0, 3)), np.zeros((0, 3)), 1.0, 2, 2).f.shape == (2, 0, 3)


def test_no_groups() -> None:
    assert pipeline_time([], [], 3.5, 2, 2) == 3.5
    out = pipeline_time(np.zeros((4, 0)), np.zeros((4, 0)), np.arange(4.0), 1, [1, 2, 3, 4])
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
    s = pipeline_schedule([], [], 1.0, 1, 1)
    assert s.n_groups == 0 and float(s.total) == 1.0


@given(
    st.integers(0, 12),
    st.integers(1, 4),
    st.integers(1, 5),
    st.integers(0, 2**32 - 1),
)
def test_broadcast_equals_elementwise(K: int, n_layers: int, n_cand: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    L = rng.random((n_layers, 1, K)) * 3
    X = rng.random((n_layers, 1, K)) * 3
    t = rng.random((n_layers, 1))
    q = rng.integers(1, 6, size=(1, n_cand))
    b = rng.integers(1, 9, size=(n_layers, n_cand))
    out = pipeline_time(L, X, t, q, b)
    sched = pipeline_schedule(L, X, t, q, b)
    assert out.shape == (n_layers, n_cand)
    for w in range(n_layers):
        for c in range(n_cand):
            one = pipeline_schedule(L[w, 0], X[w, 0], t[w, 0], int(q[0, c]), int(b[w, c]))
            assert out[w, c] == float(one.total)
            assert np.array_equal(sched.f[w, c], one.f) and np.array_equal(sched.a[w, c], one.a)


@given(st.integers(1, 6), st.integers(0, 20), st.integers(1, 5), st.data())
def test_bank_sweep_fast_path_equals_recurrence(
    W: int, K: int, q: int, data: st.DataObject
) -> None:
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    L = rng.random((W, K)) * rng.choice([0.0, 1.0, 5.0])
    X = rng.random((W, K))
    # layers with fewer scheduled groups are zero-padded at the end
    for w in range(W):
        k = int(rng.integers(0, K + 1))
        L[w, k:] = 0.0
        X[w, k:] = 0.0
    t = rng.random(W) * 4
    b_lo = data.draw(st.integers(1, 8))
    b_hi = data.draw(st.integers(b_lo, b_lo + 10))
    got = sweep_banks(L, X, t, q, b_lo, b_hi)
    bs = np.arange(b_lo, b_hi + 1)
    ref = pipeline_time(L[:, None, :], X[:, None, :], t[:, None], q, bs[None, :])
    assert np.array_equal(got, ref)


def test_padding_with_zero_groups_is_exact() -> None:
    rng = np.random.default_rng(3)
    L, X = rng.random(9), rng.random(9)
    for q in (1, 2, 3):
        for b in (1, 2, 5):
            base = pipeline_time(L, X, 0.7, q, b)
            padded = pipeline_time(np.r_[L, 0, 0, 0], np.r_[X, 0, 0, 0], 0.7, q, b)
            assert base == padded


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (([1.0], [1.0, 2.0], 0.0, 1, 1), "same number of groups"),
        (([1.0], [1.0], 0.0, 0, 1), "q must be >= 1"),
        (([1.0], [1.0], 0.0, 1, 0), "b must be >= 1"),
        (([1.0], [1.0], 0.0, 1.5, 1), "q must be an integer"),
        (([-1.0], [1.0], 0.0, 1, 1), "L must be finite and >= 0"),
        (([1.0], [np.nan], 0.0, 1, 1), "X must be finite"),
        (([1.0], [1.0], -1.0, 1, 1), "t_ne must be finite"),
        ((1.0, 1.0, 0.0, 1, 1), "group axis"),
    ],
)
def test_bad_inputs(args: tuple[object, ...], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        pipeline_time(*args)  # type: ignore[arg-type]


def test_schedule_equality_and_total() -> None:
    s = pipeline_schedule([1.0, 2.0], [1.0, 1.0], 0.5, 1, 1)
    assert s == Schedule(a=s.a, d=s.d, s=s.s, f=s.f, t_ne=0.5)
    assert s != Schedule(a=s.a, d=s.d, s=s.s, f=s.f + 1, t_ne=0.5)


@given(pipeline_instances(min_groups=1))
def test_routes_at_layer_start_never_slower_and_strictly_faster_when_reads_matter(
    inst: PipelineInstance,
) -> None:
    """Reads released at layer start (a router before attention: ``t_read = 0``) never end the
    layer later than reads that wait for the non-expert work (``t_read = t_ne``), and end it
    strictly earlier whenever that work takes time and the first read does: the path through
    the first read then starts ``t_ne`` later and bounds every other path ("takes time":
    more than 1e-9 of the layer's total, so that floating-point sums do not absorb it; a read
    of 2e-16 s after 2 s of attention ends at 2 s)."""
    at_start = f_K(inst)
    waiting = float(pipeline_time(inst.L, inst.X, inst.t_ne, inst.q, inst.b, t_read=inst.t_ne))
    assert at_start <= waiting
    scale = inst.t_ne + float(inst.L.sum()) + float(inst.X.sum())
    if min(inst.t_ne, float(inst.L[0])) > 1e-9 * scale:
        assert at_start < waiting


@given(pipeline_instances(), st.sampled_from(["round_robin", "shared_queue"]))
def test_reads_released_at_t_ne_match_the_simulator(inst: PipelineInstance, policy: str) -> None:
    """The recurrence with ``t_read = t_ne`` equals the simulator whose reads wait for the
    non-expert work (round robin exactly; a shared queue never beats it), and no read starts
    before ``t_ne``."""
    rec = pipeline_schedule(inst.L, inst.X, inst.t_ne, inst.q, inst.b, t_read=inst.t_ne)
    sim = simulate(inst.L, inst.X, inst.t_ne, inst.q, inst.b, reader_policy=policy, reads_wait=True)  # type: ignore[arg-type]
    assert np.all(rec.a >= inst.t_ne) and np.all(sim.a >= inst.t_ne)
    if policy == "round_robin":
        assert rec.allclose(sim, rtol=1e-12, atol=1e-12)


def test_release_time_hand_derived() -> None:
    """q = 1, b = 2, reads 2 s, executions 1 s, non-expert work 3 s: released at layer start
    the reads end at 2 and 4 and the layer at 5; released at ``t_ne`` they end at 5 and 7 and
    the layer at 8 (three seconds of attention no longer hide a read)."""
    early = pipeline_schedule([2, 2], [1, 1], 3.0, 1, 2)
    late = pipeline_schedule([2, 2], [1, 1], 3.0, 1, 2, t_read=3.0)
    assert early.d.tolist() == [2, 4] and early.f.tolist() == [4, 5]
    assert late.a.tolist() == [3, 5] and late.d.tolist() == [5, 7] and late.f.tolist() == [6, 8]
    with pytest.raises(ValueError, match="t_read"):
        pipeline_time([1.0], [1.0], 0.0, 1, 1, t_read=-1.0)


@given(pipeline_instances(min_groups=1, max_q=3, max_b=5))
def test_sweep_banks_with_release_equals_the_recurrence(inst: PipelineInstance) -> None:
    """The configurator's fast path with ``t_read`` gives the recurrence's ``f_K`` for every
    bank count from ``q``."""
    L, X = inst.L[None, :], inst.X[None, :]
    t = np.array([inst.t_ne])
    q = inst.q
    got = sweep_banks(L, X, t, q, q, q + 4, t_read=t)[0]
    want = [
        pipeline_time(inst.L, inst.X, inst.t_ne, q, b, t_read=inst.t_ne) for b in range(q, q + 5)
    ]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
