"""Hypothesis strategies for pipeline instances and synthetic profiles (needs ``hypothesis``,
which the ``test`` extra installs). Public so that other packages' tests and ``integration/``
can draw the same kinds of instances."""

from __future__ import annotations

import attrs
import numpy as np
from hypothesis import strategies as st

from .profile import Profile
from .synthetic import SyntheticSpec, synthetic_profile

__all__ = [
    "PipelineInstance",
    "bandwidth_tables",
    "durations",
    "pipeline_instances",
    "profiles",
    "synthetic_specs",
]


@attrs.frozen(eq=False)
class PipelineInstance:
    """One layer: ``L``, ``X`` (``[K]``), ``t_ne``, ``q``, ``b``."""

    L: np.ndarray
    X: np.ndarray
    t_ne: float
    q: int
    b: int

    @property
    def K(self) -> int:
        return int(self.L.shape[0])


def durations(max_value: float = 10.0) -> st.SearchStrategy[float]:
    """Non-negative times: zeros, ties on a coarse grid (to provoke simultaneous events) and
    arbitrary floats."""
    return st.one_of(
        st.just(0.0),
        st.integers(0, 8).map(lambda i: i * 0.5),
        st.floats(0.0, max_value, allow_nan=False, allow_infinity=False),
    )


@st.composite
def pipeline_instances(
    draw: st.DrawFn,
    *,
    max_groups: int = 24,
    max_q: int = 6,
    max_b: int = 8,
    min_groups: int = 0,
    profile_shaped: bool = False,
) -> PipelineInstance:
    """Random instances. ``profile_shaped=True`` draws read times as a profile produces them:
    non-decreasing over groups ``1..K-1`` (equal for equal-size groups) with an arbitrary last
    group (the short tail group when ``g`` does not divide ``N_e``)."""
    K = draw(st.integers(min_groups, max_groups))
    X = draw(st.lists(durations(), min_size=K, max_size=K))
    if profile_shaped:
        if draw(st.booleans()):
            head = [draw(durations())] * max(K - 1, 0)
        else:
            head = sorted(
                draw(st.lists(durations(), min_size=max(K - 1, 0), max_size=max(K - 1, 0)))
            )
        L = head + ([draw(durations())] if K else [])
    else:
        L = draw(st.lists(durations(), min_size=K, max_size=K))
    return PipelineInstance(
        L=np.asarray(L, dtype=np.float64),
        X=np.asarray(X, dtype=np.float64),
        t_ne=draw(durations(20.0)),
        q=draw(st.integers(1, max_q)),
        b=draw(st.integers(1, max_b)),
    )


@st.composite
def bandwidth_tables(
    draw: st.DrawFn, *, groups: tuple[int, ...] | None = None
) -> dict[int, dict[int, float]]:
    """``{g: {q: bytes/s}}`` with the same queue depths for every ``g``."""
    gs = groups or tuple(sorted(draw(st.sets(st.sampled_from([1, 2, 4, 8, 16]), min_size=1))))
    qs = sorted(draw(st.sets(st.integers(1, 16), min_size=1, max_size=5)))
    return {
        g: {q: draw(st.floats(1e6, 1e10, allow_nan=False, allow_infinity=False)) for q in qs}
        for g in gs
    }


@st.composite
def synthetic_specs(
    draw: st.DrawFn, *, max_experts: int = 24, max_layers: int = 4
) -> SyntheticSpec:
    """Small but varied device/model specs (group sizes, skew, unrouted experts, noise)."""
    E = draw(st.integers(2, max_experts))
    gs = tuple(
        sorted(draw(st.sets(st.sampled_from([1, 2, 3, 4, 8]).filter(lambda g: g <= E), min_size=1)))
    )
    qs = tuple(sorted(draw(st.sets(st.integers(1, 8), min_size=1, max_size=4))))
    return SyntheticSpec(
        n_experts=E,
        n_layers=draw(st.integers(1, max_layers)),
        expert_bytes=draw(st.integers(1, 64)) * 4096,
        groups=gs,
        queue_depths=qs,
        q_measured=draw(st.sampled_from(qs)),
        tokens=draw(st.integers(1, 64)),
        top_k=draw(st.integers(1, 4)),
        alpha=draw(st.floats(0.1, 5.0)),
        p_unrouted=draw(st.sampled_from([0.0, 0.0, 0.2, 0.6])),
        t0=draw(st.floats(0.0, 1e-3)),
        stream_bw=draw(st.floats(1e8, 4e9)),
        peak_bw=draw(st.floats(1e8, 8e9)),
        c_group=draw(st.floats(0.0, 1e-4)),
        c_expert=draw(st.floats(0.0, 1e-4)),
        c_route=draw(st.floats(0.0, 1e-4)),
        t_ne=draw(st.floats(0.0, 0.05)),
        m_other_base=draw(st.integers(0, 2**30)),
        m_other_per_g=draw(st.integers(0, 2**22)),
        noise=draw(st.sampled_from([0.0, 0.05])),
    )


@st.composite
def profiles(draw: st.DrawFn, **kwargs: int) -> Profile:
    """Valid synthetic profiles (see :func:`synthetic_specs`), some with a ``measured_with``."""
    spec = draw(synthetic_specs(**kwargs))
    p = synthetic_profile(spec, seed=draw(st.integers(0, 2**16)))
    value = st.one_of(
        st.text(max_size=8), st.integers(-(2**40), 2**40), st.lists(st.text(max_size=4), max_size=3)
    )
    measured_with = draw(st.dictionaries(st.text(min_size=1, max_size=8), value, max_size=4))
    return attrs.evolve(p, measured_with=measured_with) if measured_with else p
