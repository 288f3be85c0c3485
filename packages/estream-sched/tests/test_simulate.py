"""The simulator as a what-if tool: multi-layer requests and cross-layer read-ahead."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from estream_sched import pipeline_time, simulate, simulate_layers
from estream_sched.testing import PipelineInstance, durations, pipeline_instances


@st.composite
def requests(draw: st.DrawFn):
    n = draw(st.integers(1, 5))
    layers = []
    for _ in range(n):
        inst = draw(pipeline_instances(max_groups=10))
        layers.append((inst.L, inst.X, inst.t_ne))
    return layers, draw(st.integers(1, 4)), draw(st.integers(1, 6))


@given(requests())
def test_layers_back_to_back_sum_the_recurrence(req) -> None:
    layers, q, b = req
    res = simulate_layers(layers, q, b)
    per_layer = [pipeline_time(L, X, t, q, b) for L, X, t in layers]
    assert res.total_s == pytest.approx(sum(per_layer), rel=1e-9, abs=1e-12)
    # each layer starts when the previous one ends
    for i in range(1, len(layers)):
        assert res.starts[i] == pytest.approx(sum(per_layer[:i]), rel=1e-9, abs=1e-12)
        assert res.starts[i] == float(res.layers[i - 1].total)


@given(requests())
def test_cross_layer_readahead_never_slower(req) -> None:
    layers, q, b = req
    base = simulate_layers(layers, q, b)
    ahead = simulate_layers(layers, q, b, cross_layer_readahead=True)
    assert ahead.total_s <= base.total_s
    # reads of a layer may start before it does, executions never do
    for start, s in zip(ahead.starts, ahead.layers):
        if s.n_groups:
            assert np.all(s.s >= start) and np.all(s.s >= s.t_ne)


def test_readahead_hides_the_next_layers_first_read() -> None:
    layer = (np.array([1.0, 1.0]), np.array([1.0, 1.0]), 0.5)
    base = simulate_layers([layer, layer], q=1, b=4)
    ahead = simulate_layers([layer, layer], q=1, b=4, cross_layer_readahead=True)
    # base: layer 1 reads 0-1, 1-2, runs 1-2, 2-3; layer 2 (from 3) reads 3-4, 4-5, runs 4-5, 5-6.
    assert base.total_s == 6.0
    # read-ahead: layer 2's reads run 2-3, 3-4 into free banks; its groups run 3.5-4.5, 4.5-5.5.
    assert ahead.total_s == 5.5


@given(pipeline_instances(), st.sampled_from(["round_robin", "shared_queue"]))
def test_simulator_never_exceeds_q_reads_or_b_banks(inst: PipelineInstance, policy: str) -> None:
    s = simulate(inst.L, inst.X, inst.t_ne, inst.q, inst.b, reader_policy=policy)  # type: ignore[arg-type]
    for t in np.r_[s.a, s.s]:
        reading = np.sum((s.a <= t) & (t < s.d))
        holding = np.sum((s.a <= t) & (t < s.f))  # a bank is held from read start to exec end
        assert reading <= inst.q
        assert holding <= inst.b


@given(durations(), st.integers(1, 3), st.integers(1, 3))
def test_empty_layer(t: float, q: int, b: int) -> None:
    s = simulate([], [], t, q, b)
    assert s.n_groups == 0 and float(s.total) == t


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="q must be"):
        simulate([1.0], [1.0], 0.0, 0, 1)
    with pytest.raises(ValueError, match="reader_policy"):
        simulate([1.0], [1.0], 0.0, 1, 1, reader_policy="lifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="equal length"):
        simulate([1.0, 2.0], [1.0], 0.0, 1, 1)
