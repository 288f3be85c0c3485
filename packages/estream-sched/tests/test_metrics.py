"""Metrics against brute-force references on integer grids."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from estream_sched import (
    bubble_rate,
    busy_time,
    overlap,
    pareto_frontier,
    pipeline_schedule,
    schedule_metrics,
    simulate_layers,
    union,
)
from estream_sched.testing import PipelineInstance, pipeline_instances

intervals = st.lists(
    st.tuples(st.integers(0, 40), st.integers(0, 40)).map(lambda t: (min(t), max(t))), max_size=12
)


def cells(iv: list[tuple[int, int]]) -> set[int]:
    return {c for a, b in iv for c in range(a, b)}


@given(intervals)
def test_busy_time_counts_covered_unit_cells(iv: list[tuple[int, int]]) -> None:
    assert busy_time(iv) == len(cells(iv))
    u = union(iv)
    assert all(a < b for a, b in u)
    assert all(u[i][1] < u[i + 1][0] for i in range(len(u) - 1))


@given(intervals, intervals)
def test_overlap_is_hidden_share_of_read_time(reads: list, execs: list) -> None:
    R, C = cells(reads), cells(execs)
    got = overlap(reads, execs)
    if not R:
        assert got == 1.0
    else:
        assert got == pytest.approx(len(R & C) / len(R), abs=1e-12)


def test_bubble_rate() -> None:
    assert bubble_rate(6.0, 8.0, 10.0) == pytest.approx(0.2)
    assert bubble_rate(10.0, 4.0, 10.0) == 0.0
    with pytest.raises(ValueError):
        bubble_rate(1.0, 1.0, 0.0)
    # on a schedule: executor busy for t_ne + sum X, loader for the union of reads
    s = pipeline_schedule([2.0, 2.0, 2.0], [1.0, 1.0, 1.0], 1.0, 1, 1)
    t_io = busy_time(zip(s.a, s.d))
    t_exec = 1.0 + s.f.sum() - s.s.sum()
    assert bubble_rate(t_io, t_exec, float(s.total)) == pytest.approx(1 - 6 / 9)


@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), max_size=30))
def test_pareto_frontier_brute_force(pts: list[tuple[int, int]]) -> None:
    idx = pareto_frontier(pts).tolist()

    def dominated(i: int) -> bool:
        m, t = pts[i]
        return any(
            (m2 <= m and t2 <= t and (m2 < m or t2 < t)) or ((m2, t2) == (m, t) and j < i)
            for j, (m2, t2) in enumerate(pts)
        )

    assert sorted(idx) == [i for i in range(len(pts)) if not dominated(i)]
    mems = [pts[i][0] for i in idx]
    lats = [pts[i][1] for i in idx]
    assert mems == sorted(mems) and all(a > b for a, b in itertools.pairwise(lats))


def test_pareto_frontier_shape_check() -> None:
    assert pareto_frontier([]).size == 0
    with pytest.raises(ValueError):
        pareto_frontier(np.zeros((3, 3)))


def test_schedule_metrics_hand_example() -> None:
    # reads 0-2, 3-5, 6-8; executor 0-1 (non-expert), 2-3, 5-6, 8-9
    s = pipeline_schedule([2.0, 2.0, 2.0], [1.0, 1.0, 1.0], 1.0, 1, 1)
    m = schedule_metrics(s)
    assert m == {
        "t_io": 6.0,
        "t_exec": 4.0,
        "t_total": 9.0,
        "bubble_rate": pytest.approx(1 - 6 / 9),
        "overlap": pytest.approx(1 / 6),  # only 0-1 of read time runs under compute
    }


@given(pipeline_instances(min_groups=1))
def test_schedule_metrics_ranges(inst: PipelineInstance) -> None:
    s = pipeline_schedule(inst.L, inst.X, inst.t_ne, inst.q, inst.b)
    m = schedule_metrics(s)
    assert m["t_exec"] == pytest.approx(inst.t_ne + inst.X.sum())
    if m["t_total"] > 0:
        assert -1e-12 <= m["bubble_rate"] <= 1
    assert 0 <= m["overlap"] <= 1 + 1e-12


def test_schedule_metrics_with_layer_offset() -> None:
    layer = ([2.0, 2.0, 2.0], [1.0, 1.0, 1.0], 1.0)
    res = simulate_layers([layer, layer], 1, 1)
    first = schedule_metrics(res.layers[0], start_s=res.starts[0])
    second = schedule_metrics(res.layers[1], start_s=res.starts[1])
    assert first == second
