"""The configurator: Q0, zero regret against an exhaustive sweep of the model, the memory
constraint, the minimum-budget error, and the documented service-time model."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from estream_sched import (
    BudgetError,
    Choice,
    Profile,
    ProfileError,
    SyntheticSpec,
    choose_q0,
    configure,
    pipeline_time,
    synthetic_profile,
)
from estream_sched.testing import bandwidth_tables, profiles


def reference_layers(profile: Profile, g: int, q: int, read_model: str = "calibrated"):
    """Independent restatement of the README's model: per calibration layer (L, X, t_ne)."""
    qm = profile.q_measured
    bw = profile.bandwidth[g]
    layers = profile.candidates[g]
    routed_bytes = sum(
        float(nb) for lp in layers for nb, r in zip(lp.group_bytes, lp.routes) if r > 0
    )
    routed_time = sum(float(t) for lp in layers for t, r in zip(lp.read_times, lp.routes) if r > 0)
    lam = routed_time / routed_bytes if routed_bytes else 0.0
    out = []
    for w, lp in enumerate(layers):
        t_ne = float(np.mean([profile.candidates[h][w].t_ne for h in profile.groups]))
        keep = lp.routes > 0
        nb = lp.group_bytes[keep].astype(float)
        if read_model == "bandwidth":
            L = nb * q / bw[q]
        elif read_model == "measured":
            L = lp.read_times[keep] * (q / bw[q]) / (qm / bw[qm])
        else:
            L = nb * lam * (q / bw[q]) / (qm / bw[qm])
        out.append((L, lp.exec_times[keep], t_ne))
    return out


def exhaustive(profile: Profile, budget: int, q: int, read_model: str = "calibrated"):
    """Every (g, b) at queue depth q with memory <= budget: {(g, b): mean T_pipe}."""
    res = {}
    for g in profile.groups:
        layers = reference_layers(profile, g, q, read_model)
        for b in range(q, math.ceil(profile.n_experts / g) + 1):
            mem = profile.m_other[g] + b * g * profile.expert_bytes
            if mem > budget:
                continue
            res[(g, b)] = float(np.mean([pipeline_time(L, X, t, q, b) for L, X, t in layers]))
    return res


def minimum_memory(profile: Profile, q: int) -> int:
    return min(
        profile.m_other[g] + q * g * profile.expert_bytes
        for g in profile.groups
        if math.ceil(profile.n_experts / g) >= q
    )


def test_choose_q0_examples() -> None:
    bw = {1: {1: 1.0, 2: 1.9, 4: 2.0}, 8: {1: 1.5, 2: 2.0, 4: 2.0}}
    assert choose_q0(bw, rule="every-g") == 2  # 1.9 / 2.0 = 0.95 reaches the threshold exactly
    assert choose_q0(bw) == 2
    bw[1][2] = 1.89
    assert choose_q0(bw, rule="every-g") == 4  # one g below 95% at q=2 forces the deeper queue
    assert choose_q0(bw, rule="every-g", threshold=0.9) == 2
    assert choose_q0(bw) == 2  # pooled: the device's curve at q=2 is 97% of its peak
    assert choose_q0({4: {3: 5.0}}) == 3 == choose_q0({4: {3: 5.0}}, rule="every-g")
    # a noisy flat disk (the Mixtral-8x7B profile of bench_scale, GB/s): one g peaks at q=8 and
    # the per-g rule takes the deepest queue; the device curve peaks at q=4
    noisy = {
        1: {1: 1.08, 2: 1.32, 4: 1.25, 8: 1.16},
        2: {1: 1.06, 2: 1.53, 4: 1.10, 8: 1.37},
        4: {1: 1.26, 2: 1.08, 4: 1.39, 8: 1.12},
        8: {1: 1.44, 2: 1.02, 4: 1.42, 8: 1.06},
    }
    assert choose_q0(noisy, rule="every-g") == 8
    assert choose_q0(noisy) == 4
    with pytest.raises(ValueError, match="rule"):
        choose_q0(noisy, rule="median")  # type: ignore[arg-type]


@given(bandwidth_tables())
def test_choose_q0_is_the_smallest_depth_reaching_95_percent_for_every_g(bw) -> None:
    q0 = choose_q0(bw, rule="every-g")
    qs = sorted(next(iter(bw.values())))

    def worst(q: int) -> float:
        return min(row[q] / max(row.values()) for row in bw.values())

    if any(worst(q) >= 0.95 for q in qs):
        assert worst(q0) >= 0.95
        assert not any(worst(q) >= 0.95 for q in qs if q < q0)
    else:  # fallback: the best worst-case ratio, shallowest on ties
        assert worst(q0) == max(worst(q) for q in qs)
        assert not any(worst(q) == worst(q0) for q in qs if q < q0)


@given(bandwidth_tables())
def test_choose_q0_pooled_is_the_smallest_depth_of_the_device_curve(bw) -> None:
    q0 = choose_q0(bw)
    qs = sorted(next(iter(bw.values())))
    rows = [[row[q] / (sum(row[x] for x in qs) / len(qs)) for q in qs] for row in bw.values()]
    curve = {q: float(np.median([r[i] for r in rows])) for i, q in enumerate(qs)}
    top = max(curve.values())
    assert curve[q0] >= 0.95 * top * (1 - 1e-12)
    assert not any(curve[q] >= 0.95 * top * (1 + 1e-12) for q in qs if q < q0)


@given(
    st.lists(st.floats(0.05, 1.0), min_size=1, max_size=5),
    st.lists(st.floats(1e6, 1e10), min_size=1, max_size=5),
)
def test_choose_q0_rules_agree_when_every_g_has_the_device_curve(shape, scale) -> None:
    """BW(g, q) = A(g) · S(q): queue depth is then purely a device property and both rules
    must pick the same depth (the pooled rule only differs once the g's curves disagree)."""
    qs = [1, 2, 4, 8, 16][: len(shape)]
    bw = {g: {q: a * s for q, s in zip(qs, shape)} for g, a in zip([1, 2, 4, 8, 16], scale)}
    top = max(shape)
    # away from the threshold, where rounding of the two computations could differ
    assume(all(abs(s / top - 0.95) > 1e-9 for s in shape))
    assert choose_q0(bw) == choose_q0(bw, rule="every-g")


@given(profiles(), st.floats(0.0, 1.0), st.sampled_from(["calibrated", "bandwidth", "measured"]))
def test_zero_regret_against_exhaustive_sweep(p: Profile, frac: float, read_model: str) -> None:
    # The configurator fixes Q = Q0, so the exhaustive sweep is over every feasible (g, b) at Q0.
    q0 = choose_q0(p.bandwidth)
    assume(any(math.ceil(p.n_experts / g) >= q0 for g in p.groups))
    lo = minimum_memory(p, q0)
    hi = max(p.m_other[g] + math.ceil(p.n_experts / g) * g * p.expert_bytes for g in p.groups)
    budget = int(lo + frac * (hi - lo))
    choice = configure(p, budget, read_model=read_model)
    sweep = exhaustive(p, budget, q0, read_model)
    best = min(sweep.values())
    mine = sweep[(choice.G, choice.B)]  # evaluated by the test's own model, not the configurator's
    assert mine <= best * (1 + 1e-12)
    assert q0 == choice.Q
    assert choice.memory_bytes <= budget
    assert choice.memory_bytes == p.m_other[choice.G] + choice.B * choice.G * p.expert_bytes
    assert choice.per_layer_s == pytest.approx(mine, rel=1e-12, abs=0)
    assert choice.predicted_s == pytest.approx(p.n_layers * mine, rel=1e-12, abs=0)
    # the table covers the whole (g, b) landscape at Q0 and marks exactly the feasible rows
    feasible = {(r.g, r.b) for r in choice.table if r.feasible}
    assert feasible == set(sweep)
    for r in choice.table:
        assert r.feasible == (r.memory_bytes <= budget)
        if r.feasible:
            assert r.per_layer_s == pytest.approx(sweep[(r.g, r.b)], rel=1e-12, abs=0)


@given(profiles(), st.integers(0, 2**20))
def test_budget_below_minimum_raises_with_the_minimum(p: Profile, short: int) -> None:
    q0 = choose_q0(p.bandwidth)
    assume(any(math.ceil(p.n_experts / g) >= q0 for g in p.groups))
    minimum = minimum_memory(p, q0)
    with pytest.raises(BudgetError) as exc:
        configure(p, minimum - 1 - short)
    assert exc.value.minimum_bytes == minimum
    assert f"({minimum} B)" in str(exc.value)
    g, q, b = exc.value.minimum_config
    assert (q, b) == (q0, q0)
    assert p.m_other[g] + b * g * p.expert_bytes == minimum
    ok = configure(p, minimum)
    assert ok.memory_bytes <= minimum


def test_budget_error_message() -> None:
    p = synthetic_profile(SyntheticSpec(n_layers=2, m_other_base=400 * 2**20, m_other_per_g=0))
    with pytest.raises(BudgetError) as exc:
        configure(p, 300 * 2**20)
    assert str(exc.value) == (
        "budget 300 MiB (314572800 B) is below the minimum 406.75 MiB (426508288 B) "
        "(G=1, Q=2, B=2); raise the budget to at least 426508288 bytes"
    )


@given(profiles(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_more_memory_never_predicts_slower(p: Profile, f1: float, f2: float) -> None:
    q0 = choose_q0(p.bandwidth)
    assume(any(math.ceil(p.n_experts / g) >= q0 for g in p.groups))
    lo = minimum_memory(p, q0)
    span = p.n_experts * p.expert_bytes * 2
    small, big = sorted((int(lo + f1 * span), int(lo + f2 * span)))
    assert configure(p, big).per_layer_s <= configure(p, small).per_layer_s


def test_realistic_profile_choice_and_manifest_entry() -> None:
    p = synthetic_profile(SyntheticSpec(n_layers=8), seed=5)
    c = configure(p, 1024 * 2**20)
    assert isinstance(c, Choice)
    d = c.to_dict()
    assert {"G", "Q", "B", "budget_bytes", "predicted_s"} <= set(d)
    assert d["budget_bytes"] == 1024 * 2**20
    # a given q0 overrides the bandwidth rule; an unmeasured depth is an error
    assert configure(p, 1024 * 2**20, q0=4).Q == 4
    with pytest.raises(ValueError, match="q=3 was not measured"):
        configure(p, 1024 * 2**20, q0=3)
    with pytest.raises(ValueError, match="read_model"):
        configure(p, 1024 * 2**20, read_model="magic")  # type: ignore[arg-type]


def test_no_group_size_can_hold_q0_banks() -> None:
    spec = SyntheticSpec(n_experts=4, n_layers=1, groups=(4,), queue_depths=(1, 2))
    p = synthetic_profile(spec)
    with pytest.raises(ProfileError, match=r"at least Q0=2 groups"):
        configure(p, 2**40, q0=2)
