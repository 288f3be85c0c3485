"""The configurator: Q0, zero regret against an exhaustive sweep of the model, the memory
constraint, the minimum-budget error, and the documented service-time model."""

from __future__ import annotations

import math

import attrs
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from estream_sched import (
    DEFAULT_READ_MARGIN,
    BudgetError,
    Choice,
    LayerProfile,
    Profile,
    ProfileError,
    SyntheticSpec,
    choose_q0,
    configure,
    format_bytes,
    pipeline_time,
    sweep,
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


def exhaustive(
    profile: Profile, budget: int, q: int, read_model: str = "calibrated", read_scale: float = 1.0
):
    """Every (g, b) at queue depth q with memory <= budget: {(g, b): mean T_pipe}, every read
    ``read_scale`` times as long as the model's."""
    res = {}
    for g in profile.groups:
        layers = reference_layers(profile, g, q, read_model)
        for b in range(q, math.ceil(profile.n_experts / g) + 1):
            mem = profile.m_other[g] + b * g * profile.expert_bytes
            if mem > budget:
                continue
            res[(g, b)] = float(
                np.mean([pipeline_time(L * read_scale, X, t, q, b) for L, X, t in layers])
            )
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


def _depths(p: Profile, q_rule: str) -> list[int]:
    """The queue depths a rule lets the configurator consider."""
    if q_rule == "model":
        return sorted(set.intersection(*[set(p.bandwidth[g]) for g in p.groups]))
    return [choose_q0(p.bandwidth, rule=q_rule)]


@pytest.mark.parametrize("q_rule", ["model", "pooled"])
@given(
    profiles(),
    st.floats(0.0, 1.0),
    st.sampled_from(["calibrated", "bandwidth", "measured"]),
    st.sampled_from([0.0, 0.5, 2.0]),
)
def test_zero_regret_against_exhaustive_sweep(
    q_rule: str, p: Profile, frac: float, read_model: str, margin: float
) -> None:
    # "model": the exhaustive sweep is over every feasible (g, q, b) with q any depth measured
    # for every g; "pooled": over every feasible (g, b) at Q = Q0. The choice is the sweep's
    # minimum with every read 1 + margin times as long; its reported times are the profiled
    # reads' (no margin).
    depths = [
        q for q in _depths(p, q_rule) if any(math.ceil(p.n_experts / g) >= q for g in p.groups)
    ]
    assume(depths)
    lo = min(minimum_memory(p, q) for q in depths)
    hi = max(p.m_other[g] + math.ceil(p.n_experts / g) * g * p.expert_bytes for g in p.groups)
    budget = int(lo + frac * (hi - lo))
    choice = configure(p, budget, q_rule=q_rule, read_model=read_model, read_margin=margin)
    sweep = {
        (g, q, b): v for q in depths for (g, b), v in exhaustive(p, budget, q, read_model).items()
    }
    slow = {
        (g, q, b): v
        for q in depths
        for (g, b), v in exhaustive(p, budget, q, read_model, 1.0 + margin).items()
    }
    key = (choice.G, choice.Q, choice.B)
    assert slow[key] <= min(slow.values()) * (1 + 1e-12)
    # among the slow-reads minima, the best at the profiled reads
    ties = [k for k, v in slow.items() if v <= slow[key] * (1 + 1e-12)]
    assert sweep[key] <= min(sweep[k] for k in ties) * (1 + 1e-12)
    if margin == 0.0:
        assert sweep[key] <= min(sweep.values()) * (1 + 1e-12)
    mine = sweep[key]  # evaluated by the test's own model
    assert choice.Q in depths
    assert choice.memory_bytes <= budget
    assert choice.memory_bytes == p.m_other[choice.G] + choice.B * choice.G * p.expert_bytes
    assert choice.per_layer_s == pytest.approx(mine, rel=1e-12, abs=0)
    assert choice.predicted_s == pytest.approx(p.n_layers * mine, rel=1e-12, abs=0)
    assert choice.slow_reads_s == pytest.approx(p.n_layers * slow[key], rel=1e-12, abs=0)
    assert choice.read_margin == margin
    # the table covers the whole (g, q, b) landscape and marks exactly the feasible rows
    feasible = {(r.g, r.q, r.b) for r in choice.table if r.feasible}
    assert feasible == set(sweep)
    for r in choice.table:
        assert r.feasible == (r.memory_bytes <= budget)
        if r.feasible:
            k = (r.g, r.q, r.b)
            assert r.per_layer_s == pytest.approx(sweep[k], rel=1e-12, abs=0)
            assert r.slow_reads_s == pytest.approx(p.n_layers * slow[k], rel=1e-12, abs=0)


def test_model_rule_weighs_every_depth_and_q0_still_fixes_it() -> None:
    """Bandwidths of a measured Mixtral-8x7B profile (GB/s, flat within noise): the
    pooled Q0 rule takes q=4; the model rule evaluates every measured depth and is never
    predicted slower; ``q0=`` still fixes the depth under either rule."""
    from estream_sched.synthetic import synthetic_profile

    p = synthetic_profile(seed=3)
    mixtral = (0.83, 1.06, 0.98, 1.00), (1.09, 0.95, 1.13, 1.03), (0.89, 0.95, 0.99, 0.96)
    bw = {
        g: dict(zip((1, 2, 4, 8), (v * 1e9 for v in mixtral[i % 3])))
        for i, g in enumerate(p.groups)
    }
    p = attrs.evolve(p, bandwidth=bw)
    budget = 4 << 30
    model = configure(p, budget)
    pooled = configure(p, budget, q_rule="pooled")
    assert choose_q0(bw) == pooled.Q
    assert {r.q for r in model.table} == {1, 2, 4, 8}
    assert {r.q for r in pooled.table} == {pooled.Q}
    assert model.predicted_s <= pooled.predicted_s
    for rule in ("model", "pooled"):
        assert configure(p, budget, q0=2, q_rule=rule).Q == 2  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="q_rule must be one of"):
        configure(p, budget, q_rule="deepest")  # type: ignore[arg-type]


@pytest.mark.parametrize("q_rule", ["model", "pooled"])
@given(profiles(), st.integers(0, 2**20))
def test_budget_below_minimum_raises_with_the_minimum(q_rule: str, p: Profile, short: int) -> None:
    depths = [
        q for q in _depths(p, q_rule) if any(math.ceil(p.n_experts / g) >= q for g in p.groups)
    ]
    assume(depths)
    q0 = min(depths)
    minimum = minimum_memory(p, q0)
    with pytest.raises(BudgetError) as exc:
        configure(p, minimum - 1 - short, q_rule=q_rule)
    assert exc.value.minimum_bytes == minimum
    assert f"({minimum} B)" in str(exc.value)
    g, q, b = exc.value.minimum_config
    assert (q, b) == (q0, q0)
    assert p.m_other[g] + b * g * p.expert_bytes == minimum
    ok = configure(p, minimum, q_rule=q_rule)
    assert ok.memory_bytes <= minimum


def test_budget_error_message() -> None:
    p = synthetic_profile(SyntheticSpec(n_layers=2, m_other_base=400 * 2**20, m_other_per_g=0))
    with pytest.raises(BudgetError) as exc:
        configure(p, 300 * 2**20, q_rule="pooled")  # Q = Q0 = 2
    assert str(exc.value) == (
        "budget 300 MiB (314572800 B) is below the minimum 406.75 MiB (426508288 B) "
        "(G=1, Q=2, B=2); raise the budget to at least 426508288 bytes"
    )
    with pytest.raises(BudgetError) as exc:  # the model rule may go down to the shallowest depth
        configure(p, 300 * 2**20)
    assert str(exc.value) == (
        "budget 300 MiB (314572800 B) is below the minimum 403.38 MiB (422969344 B) "
        "(G=1, Q=1, B=1); raise the budget to at least 422969344 bytes"
    )


@given(profiles(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_more_memory_never_predicts_slower(p: Profile, f1: float, f2: float) -> None:
    depths = [
        q for q in _depths(p, "model") if any(math.ceil(p.n_experts / g) >= q for g in p.groups)
    ]
    assume(depths)
    lo = min(minimum_memory(p, q) for q in depths)
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
    with pytest.raises(ProfileError, match=r"at least Q=2 groups"):
        configure(p, 2**40, q0=2)


@given(profiles(), st.lists(st.floats(0.0, 1.0), min_size=2, max_size=4))
def test_cached_sweeps_give_what_a_fresh_profile_gives(p: Profile, fracs: list[float]) -> None:
    """The budget-independent sweep is cached on the profile: a run of budgets on one profile
    chooses what each budget chooses on a freshly loaded copy, and the cache is read-only."""
    depths = [
        q for q in _depths(p, "model") if any(math.ceil(p.n_experts / g) >= q for g in p.groups)
    ]
    assume(depths)
    lo = min(minimum_memory(p, q) for q in depths)
    hi = max(p.m_other[g] + math.ceil(p.n_experts / g) * g * p.expert_bytes for g in p.groups)
    for f in fracs:
        budget = int(lo + f * (hi - lo))
        warm = configure(p, budget)
        fresh = configure(Profile.from_dict(p.to_dict()), budget)
        assert (warm.G, warm.Q, warm.B, warm.per_layer_s) == (
            fresh.G,
            fresh.Q,
            fresh.B,
            fresh.per_layer_s,
        )
        assert warm.table == fresh.table
    (_bs, mean), *_ = sweep(p, q=depths[0]).values()
    with pytest.raises(ValueError):
        mean[0] = 0.0


def test_scaled_exec_times_keep_the_fixed_part_per_op() -> None:
    """X = a + c·routes scales to a + c·routes·s (the fixed part per op stays); routes too alike
    to fit a slope scale proportionally; unrouted groups stay unscheduled (0)."""
    from estream_sched.configure import scaled_exec_times

    routes = np.array([[10, 0, 30, 20], [5, 40, 0, 25]])
    execs = np.where(routes > 0, 2e-3 + 1e-4 * routes, 0.0)
    got = scaled_exec_times(routes, execs, 4.0)
    assert np.allclose(got, np.where(routes > 0, 2e-3 + 4e-4 * routes, 0.0), rtol=1e-12)
    assert np.array_equal(scaled_exec_times(routes, execs, 1.0), execs)
    flat = np.array([[7, 7, 0]])
    assert np.allclose(scaled_exec_times(flat, np.array([[1.0, 2.0, 0.0]]), 3.0), [[3, 6, 0]])
    falling = np.array([[10, 20, 30]])  # a negative slope: proportional, never negative times
    assert np.allclose(scaled_exec_times(falling, np.array([[3.0, 2.0, 1.0]]), 2.0), [[6, 4, 2]])


def test_route_slope_is_one_slope_with_an_intercept_per_run() -> None:
    """X = a_i + c·routes in every run, with a different fixed cost a_i per run: the common
    slope is c exactly; runs with fewer than two routed groups, or alike routes, add nothing."""
    from estream_sched.configure import route_slope

    rng = np.random.default_rng(7)
    c = 3.7e-5
    runs = []
    for a in (1e-3, 4e-3, 0.0):
        r = rng.integers(0, 300, size=(5, 9))
        runs.append((r, np.where(r > 0, a + c * r, 0.0)))
    lone = np.array([[0, 12, 0]])
    runs.append((lone, np.where(lone > 0, 9.0, 0.0)))  # one routed group: no slope in it
    flat = np.array([[5, 5, 5]])
    runs.append((flat, np.array([[1.0, 2.0, 3.0]])))  # alike routes: no slope in it
    assert route_slope(runs) == pytest.approx(c, rel=1e-9)
    assert route_slope([(lone, np.ones((1, 3))), (flat, np.ones((1, 3)))]) == 0.0
    # and the slope passed in is the one used
    from estream_sched.configure import scaled_exec_times

    r, x = runs[0]
    assert np.allclose(
        scaled_exec_times(r, x, 3.0, slope=1e-4), np.where(r > 0, x + 1e-4 * r * 2.0, 0.0)
    )


def test_a_longer_prompt_adds_the_same_route_time_to_every_g() -> None:
    """Every g routes the same tokens, so a longer prompt adds the same per-route time to each
    g's layers; noisy calibration times must not turn into different per-route costs per g
    (slopes fitted per g did: their noise, times the new routes, chose G)."""
    from estream_sched.configure import model_arrays

    p = synthetic_profile(SyntheticSpec(tokens=256, noise=0.05), seed=11)
    at_cal = model_arrays(p, 1)
    at_4x = model_arrays(p, 1, tokens=1024)
    added = {g: float((at_4x[g].X - at_cal[g].X).sum()) for g in p.groups}
    routes = {g: float(np.stack([lp.routes for lp in p.candidates[g]]).sum()) for g in p.groups}
    assert len(set(routes.values())) == 1  # the premise: the same routes for every g
    ref = added[p.groups[0]]
    assert ref > 0
    for g in p.groups:
        assert added[g] == pytest.approx(ref, rel=1e-9), (g, added)


@pytest.mark.parametrize("budget", [1 << 30, 3 << 30])
def test_configure_for_a_longer_prompt_than_the_calibration(budget: int) -> None:
    """Calibrated at 256 tokens, configured for 2048: the choice is the one a calibration at
    2048 tokens makes (its true time within 0.5 % of the best there), while the choice for the
    calibration length, whose per-op fixed costs hide behind reads at 256 tokens, is slower."""
    cal = synthetic_profile(SyntheticSpec(tokens=256, noise=0.0, c_group=1e-3), seed=3)
    # the truth at 2048 tokens: same router popularity, 8x the routes and the non-expert time
    true = synthetic_profile(
        SyntheticSpec(tokens=2048, noise=0.0, c_group=1e-3, t_ne=8 * 15e-3), seed=3
    )
    best = configure(true, budget)
    times = {(r.g, r.q, r.b): r.predicted_s for r in best.table if r.feasible}
    long = configure(cal, budget, tokens=2048)
    short = configure(cal, budget)
    assert long.tokens == 2048 and short.tokens == 256
    assert long.to_dict()["tokens"] == 2048
    assert times[(long.G, long.Q, long.B)] <= 1.005 * best.predicted_s
    assert abs(long.predicted_s - times[(long.G, long.Q, long.B)]) <= 0.02 * long.predicted_s
    assert times[(short.G, short.Q, short.B)] >= 1.05 * best.predicted_s
    # the calibration length itself: the measured times, the same choice as without tokens
    same = configure(cal, budget, tokens=256)
    assert (same.G, same.Q, same.B, same.predicted_s) == (
        short.G,
        short.Q,
        short.B,
        short.predicted_s,
    )


@given(profiles(), st.floats(0.0, 1.0), st.integers(1, 2**28))
def test_extra_bytes_count_in_every_configuration_s_memory(
    p: Profile, frac: float, extra: int
) -> None:
    """A request's ``extra_bytes`` (memory beyond the profile's measured ``M_other``) is part of
    every candidate's memory: the choice for ``budget`` with ``extra`` is the one for
    ``budget - extra`` without it, its memory ``extra`` more; below the minimum the error's
    minimum holds it too."""
    depths = [
        q for q in _depths(p, "model") if any(math.ceil(p.n_experts / g) >= q for g in p.groups)
    ]
    assume(depths)
    lo = min(minimum_memory(p, q) for q in depths)
    budget = int(lo + extra + frac * p.n_experts * p.expert_bytes)
    plain = configure(p, budget - extra)
    more = configure(p, budget, extra_bytes=extra)
    assert (more.G, more.Q, more.B, more.per_layer_s) == (
        plain.G,
        plain.Q,
        plain.B,
        plain.per_layer_s,
    )
    assert more.memory_bytes == plain.memory_bytes + extra <= budget
    assert more.extra_bytes == more.to_dict()["extra_bytes"] == extra and plain.extra_bytes == 0
    for r, r0 in zip(more.table, plain.table, strict=True):
        assert (r.g, r.q, r.b, r.feasible) == (r0.g, r0.q, r0.b, r0.feasible)
        assert r.memory_bytes == r0.memory_bytes + extra
    with pytest.raises(BudgetError) as exc:
        configure(p, lo + extra - 1, extra_bytes=extra)
    assert exc.value.minimum_bytes == lo + extra
    assert f"{format_bytes(extra)} of it beyond the calibration request's" in str(exc.value)
    configure(p, lo + extra, extra_bytes=extra)  # the minimum itself fits
    with pytest.raises(ValueError, match="extra_bytes must be >= 0"):
        configure(p, budget, extra_bytes=-1)


def test_a_profile_s_memory_per_token_counts_for_a_longer_prompt() -> None:
    """A profile that records ``m_per_token``: configured for ``tokens`` beyond its calibration
    prompt, every configuration holds ``m_per_token`` more per extra token (nothing for the
    calibration length or a shorter prompt, nothing without ``tokens``); an explicit
    ``extra_bytes`` replaces it."""
    p = synthetic_profile(SyntheticSpec(n_layers=4, tokens=256), seed=2)
    p = attrs.evolve(p, m_per_token=150_000)
    budget = 8 << 30
    for tokens, extra in ((None, 0), (128, 0), (256, 0), (1024, 768 * 150_000)):
        c = configure(p, budget, tokens=tokens)
        assert c.extra_bytes == extra
        assert c.memory_bytes == p.m_other[c.G] + extra + c.B * c.G * p.expert_bytes
    assert configure(p, budget, tokens=1024, extra_bytes=7).extra_bytes == 7
    with pytest.raises(BudgetError) as exc:
        configure(p, minimum_memory(p, 1) + 768 * 150_000 - 1, tokens=1024)
    assert exc.value.minimum_bytes == minimum_memory(p, 1) + 768 * 150_000


def test_configure_tokens_errors() -> None:
    p = synthetic_profile(SyntheticSpec(n_layers=2), seed=1)
    with pytest.raises(ValueError, match="tokens must be >= 1"):
        configure(p, 2**40, tokens=0)
    bare = attrs.evolve(p, meta={})
    with pytest.raises(ProfileError, match="calibration prompt length"):
        configure(bare, 2**40, tokens=512)
    assert configure(bare, 2**40).tokens is None


@given(profiles(), st.floats(0.0, 1.0))
def test_routes_at_layer_start_never_predict_slower_after_routing(p: Profile, f: float) -> None:
    """``after-routing``: with the router before attention (reads at layer start) the chosen
    configuration's predicted time is never above the one whose reads wait for ``T_ne``, and it
    equals ``early``'s (both release the reads at layer start); ``early`` ignores the flag."""
    depths = [
        q for q in _depths(p, "model") if any(math.ceil(p.n_experts / g) >= q for g in p.groups)
    ]
    assume(depths)
    budget = int(min(minimum_memory(p, q) for q in depths) + f * p.n_experts * p.expert_bytes * 2)
    waits = configure(p, budget, schedule="after-routing")
    at_start = configure(p, budget, schedule="after-routing", routes_at_layer_start=True)
    early = configure(p, budget)
    assert at_start.predicted_s <= waits.predicted_s
    assert at_start.predicted_s == early.predicted_s
    assert configure(p, budget, routes_at_layer_start=True).predicted_s == early.predicted_s


def test_routes_at_layer_start_hide_reads_behind_attention() -> None:
    """On a read-bound profile with non-expert work (t_ne > 0), pre-attention routing predicts
    strictly less than reads that wait for the router after attention, for the same (G, Q, B)
    and for the configurator's choice; the gap is at most one T_ne per layer."""
    spec = SyntheticSpec(n_layers=4, t_ne=5e-3, stream_bw=2e8, peak_bw=4e8)
    p = synthetic_profile(spec, seed=3)
    budget = 1024 * 2**20
    waits = configure(p, budget, schedule="after-routing")
    at_start = configure(p, budget, schedule="after-routing", routes_at_layer_start=True)
    assert at_start.predicted_s < waits.predicted_s
    fixed = {"q0": waits.Q}
    same = configure(p, budget, schedule="after-routing", routes_at_layer_start=True, **fixed)
    row = next(r for r in same.table if (r.g, r.b) == (waits.G, waits.B))
    assert row.predicted_s < waits.predicted_s
    t_ne = max(lp.t_ne for g in p.groups for lp in p.candidates[g])
    assert waits.predicted_s - row.predicted_s <= p.n_layers * t_ne * (1 + 1e-9)
    with pytest.raises(ValueError, match="schedule"):
        configure(p, budget, schedule="ondemand")  # type: ignore[arg-type]


def _fragile_and_robust() -> Profile:
    """Four 100-byte experts read at 100 B/s, 2 s of attention, one layer. G=2: two 2 s reads
    behind 2.2 s of compute each, hidden with 0.2 s to spare; G=1: four 1 s reads behind
    1.15 s each (more per-op cost: 4.6 s of compute against 4.4 s)."""

    def layer(g: int, exec_s: float) -> LayerProfile:
        n = 4 // g
        return LayerProfile(
            t_ne=2.0,
            group_bytes=[100 * g] * n,
            routes=[10] * n,
            read_times=[1.0 * g] * n,
            exec_times=[exec_s] * n,
            layer=0,
        )

    return Profile(
        model="m",
        device="d",
        n_experts=4,
        n_layers=1,
        expert_bytes=100,
        q_measured=1,
        m_other={1: 1000, 2: 1000},
        bandwidth={1: {1: 100.0}, 2: {1: 100.0}},
        candidates={1: [layer(1, 1.15)], 2: [layer(2, 2.2)]},
    )


def test_read_margin_prefers_the_configuration_that_keeps_hiding_slower_reads() -> None:
    """By hand: G=2 B=2 finishes at 2 + 2.2 + 2.2 = 6.4 s, and with reads 1.5 times as long
    (3 s) at 3 + 2.2, then 6 + 2.2 = 8.2 s; G=1 B=3 at 2 + 4 · 1.15 = 6.6 s, and with 1.5 s
    reads its third group waits for its read (4.5 s) and its fourth (6 s): 7.15 s."""
    p = _fragile_and_robust()
    plain = configure(p, 1400, read_margin=0.0)
    assert (plain.G, plain.Q, plain.B) == (2, 1, 2)
    assert plain.predicted_s == pytest.approx(6.4) and plain.slow_reads_s == plain.predicted_s
    robust = configure(p, 1400)  # DEFAULT_READ_MARGIN: 0.5
    assert DEFAULT_READ_MARGIN == 0.5 and robust.read_margin == 0.5
    assert (robust.G, robust.Q, robust.B) == (1, 1, 3)  # the fewest banks of the ties (b=3, 4)
    assert robust.predicted_s == pytest.approx(6.6)  # at the profiled reads
    assert robust.slow_reads_s == pytest.approx(7.15)
    rows = {(r.g, r.q, r.b): r for r in robust.table}
    assert rows[(2, 1, 2)].predicted_s == pytest.approx(6.4)
    assert rows[(2, 1, 2)].slow_reads_s == pytest.approx(8.2)
    assert robust.to_dict()["read_margin"] == 0.5
    assert robust.to_dict()["slow_reads_s"] == pytest.approx(7.15)
    # reads slower still: G=2 falls further behind; 5 % slower (2.1 s): G=2 still hides them (6.5 s)
    assert (configure(p, 1400, read_margin=2.0).G, configure(p, 1400, read_margin=0.05).G) == (1, 2)


@pytest.mark.parametrize("bad", [-0.1, 10.5, float("nan"), float("inf"), "half", None, True])
def test_read_margin_out_of_range_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="read_margin must be between 0 and 10"):
        configure(_fragile_and_robust(), 1400, read_margin=bad)
