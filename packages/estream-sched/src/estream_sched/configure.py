"""The (G, Q, B) configurator of docs/design.md §6: Q0, B_max(g), the inner search for B*(g), the
outer search for G* under a memory budget, evaluated with the max-plus model of a profile.

Service-time model (see README "Modelling choices"):

* ``L_k(g, q)`` — read service time of group ``k`` with ``q`` reads in flight. ``q`` loader
  threads share the device, which delivers ``BW(g, q)`` bytes/s in aggregate, so one read of
  ``n`` bytes takes ``n · q / BW(g, q)``. The default ``read_model="calibrated"`` keeps that
  q-dependence but anchors its level on the read times measured in the calibration request
  (pooled per ``g``: total measured read time / total bytes, at ``q_measured``)::

      L_k(g, q) = bytes_k · λ(g) · [q / BW(g, q)] / [q_m / BW(g, q_m)]

  ``"bandwidth"`` uses ``bytes_k · q / BW(g, q)`` alone; ``"measured"`` scales every group's own
  measured read time by the same bandwidth ratio.
* ``X_k(g)`` — the execution time measured for that group in the calibration run of that ``g``.
* ``T_ne`` — per layer, pooled (averaged) across the ``g`` runs (it does not depend on ``g``).
* A request of ``T`` tokens (``configure(..., tokens=T)``), ``s = T / T_cal`` times the
  calibration prompt: a group's time is a fixed part per op (weights through the caches, thread
  hand-offs) plus a part per route, ``X ≈ a(g) + c · routes``: one intercept per ``g`` and
  one slope ``c`` for every ``g`` (a route costs the kernel the same whatever the grouping),
  fitted by least squares over the routed groups of every calibration run (`route_slope`);
  each group keeps its measured time and gains ``c · routes_k · (s - 1)``. Where the fit has no
  positive slope (route counts too alike to tell), ``X_k · s``. ``T_ne · s`` (linear: attention's quadratic share is
  understated at long prompts, which only makes reads look more exposed than they are). Reads
  do not change with ``T``.
* Groups with zero routes are dropped from the schedule, as the runtime drops them.
* When reads may start (``schedule``): ``"early"`` issues them at layer start, so they overlap
  the layer's non-expert work (attention, router). ``"after-routing"`` issues them once the
  routes are known: for most architectures the router runs after attention, so the reads start
  at ``T_ne`` and overlap nothing before it; an architecture whose router reads the layer's
  input before attention (``routes_at_layer_start=True``) knows them at layer start, and its
  routed reads overlap attention as ``early``'s do (the router's own time is taken as 0).
* A margin for a slower disk (``read_margin``, default `DEFAULT_READ_MARGIN`): the candidates
  are ranked by their predicted time with every read ``1 + read_margin`` times as long as the
  profile measured (``Row.slow_reads_s``), ties by the time as measured (``predicted_s``). A
  configuration with one large read in flight and two banks hides its reads only while the
  disk keeps the profiled rate; one with more, smaller groups keeps hiding them when it
  slows, usually for a percent or two at the profiled rate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs
import numpy as np
from numpy.typing import NDArray

from ._model import sweep_banks
from .profile import Profile, ProfileError, n_groups

__all__ = [
    "DEFAULT_READ_MARGIN",
    "MAX_READ_MARGIN",
    "BudgetError",
    "Choice",
    "Row",
    "calibration_tokens",
    "check_read_margin",
    "choose_q0",
    "configure",
    "format_bytes",
    "model_arrays",
    "reads_wait_for_attention",
    "route_slope",
    "scaled_exec_times",
    "sweep",
]

ReadModel = Literal["calibrated", "bandwidth", "measured"]
_READ_MODELS = ("calibrated", "bandwidth", "measured")
ScheduleName = Literal["early", "after-routing"]
_SCHEDULES = ("early", "after-routing")

#: How much slower than profiled the configurator lets reads be (``configure(read_margin=)``):
#: the candidates are ranked with every read 1.5 times as long. On the development VM, whose
#: profiles measured 3.2-3.7 GB/s, one quiet cold-cache run read at 2.38 GB/s (1.44 times
#: slower) and the choice made without a margin waited 1.14 s for its reads; the shared
#: disk of a phone or a VM slows as much when another reader or the host takes its share.
DEFAULT_READ_MARGIN = 0.5
#: The largest ``read_margin`` accepted: reads 11 times as long as profiled.
MAX_READ_MARGIN = 10.0


def check_read_margin(value: Any) -> float:
    """``value`` as a `configure` ``read_margin`` (a number from 0 to `MAX_READ_MARGIN`), else
    ValueError saying what it must be."""
    number = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, bool
    )
    margin = float(value) if number else float("nan")
    if not (0.0 <= margin <= MAX_READ_MARGIN):  # NaN fails too
        raise ValueError(
            f"read_margin must be between 0 and {MAX_READ_MARGIN:g} (reads taken that much "
            f"longer than profiled: 0.5 is 1.5 times as long), got {value!r}"
        )
    return margin


def reads_wait_for_attention(schedule: str, routes_at_layer_start: bool) -> bool:
    """Whether a layer's reads start only when its non-expert work ends (module docstring):
    ``after-routing`` with a router that runs after attention."""
    if schedule not in _SCHEDULES:
        raise ValueError(f"schedule must be one of {_SCHEDULES}, got {schedule!r}")
    return schedule == "after-routing" and not routes_at_layer_start


class BudgetError(ValueError):
    """The memory budget is below the smallest feasible configuration."""

    def __init__(
        self, message: str, *, budget_bytes: int, minimum_bytes: int, g: int, q: int, b: int
    ):
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.minimum_bytes = minimum_bytes
        self.minimum_config = (g, q, b)


def format_bytes(n: float) -> str:
    """``"412 MiB"`` for whole MiB, else two decimals."""
    mib = n / 2**20
    return f"{mib:.0f} MiB" if float(mib).is_integer() else f"{mib:.2f} MiB"


Q0Rule = Literal["pooled", "every-g"]
_Q0_RULES = ("pooled", "every-g")


def choose_q0(
    bandwidth: Mapping[int, Mapping[int, float]],
    *,
    threshold: float = 0.95,
    groups: list[int] | None = None,
    rule: Q0Rule = "pooled",
) -> int:
    """The smallest queue depth reaching ``threshold`` of the peak grouped-read bandwidth.

    ``rule="pooled"`` (default): queue depth is treated as a property of the device, as the
    paper characterises it once per device. Each ``g``'s row is divided by its mean over the
    depths, the device curve is the median over ``g``, ``S(q) = median_g BW(g,q) / mean_q'
    BW(g,q')``, and ``Q0 = min{q : S(q) >= threshold · max_q' S(q')}``. When every ``g`` has the
    same shape of curve (``BW(g, q) = A(g)·S(q)``) this is exactly the per-``g`` rule below; on
    a noisy disk it does not let the one ``g`` whose noisy peak landed at a deep ``q`` decide
    for all of them (the minimum over ``g`` amplifies noise, the median does not).

    ``rule="every-g"``: the literal rule of design §6, ``Q0 = min{q : min_g BW(g,q) / max_q'
    BW(g,q') >= threshold}``; if no depth reaches it for every ``g`` at once, the depth
    maximising that worst-case ratio (the shallowest on ties).

    Only depths measured for every ``g`` are considered."""
    if rule not in _Q0_RULES:
        raise ValueError(f"rule must be one of {_Q0_RULES}, got {rule!r}")
    gs = sorted(bandwidth) if groups is None else sorted(groups)
    if not gs:
        raise ValueError("bandwidth table is empty")
    qsets = [set(bandwidth[g]) for g in gs]
    qs = sorted(set.intersection(*qsets))
    if not qs:
        raise ValueError("no queue depth was measured for every g")
    if rule == "pooled":
        rel = np.array(
            [[bandwidth[g][q] for q in qs] for g in gs], dtype=np.float64
        )  # [g, q] over the common depths
        rel /= rel.mean(axis=1, keepdims=True)
        curve = np.median(rel, axis=0)
        top = float(curve.max())
        return int(next(q for q, v in zip(qs, curve.tolist()) if v >= threshold * top))
    ratio = {q: min(bandwidth[g][q] / max(bandwidth[g].values()) for g in gs) for q in qs}
    for q in qs:
        if ratio[q] >= threshold:
            return int(q)
    # No depth reaches the threshold for every g at once (the peaks sit at different q): take
    # the depth with the best worst-case ratio, the shallowest on ties.
    return int(max(qs, key=lambda q: (ratio[q], -q)))


@attrs.frozen
class Row:
    """One candidate ``(g, q, b)``: predicted MoE-layer time of the request and its memory."""

    g: int
    b: int
    q: int
    predicted_s: float
    memory_bytes: int
    feasible: bool
    per_layer_s: float
    #: ``predicted_s`` with every read ``1 + read_margin`` times as long (`configure`).
    slow_reads_s: float = 0.0


@attrs.frozen
class Choice:
    """The configurator's answer; ``table`` holds every evaluated ``(g, b)`` at ``q = Q``."""

    G: int
    Q: int
    B: int
    predicted_s: float
    memory_bytes: int
    budget_bytes: int
    per_layer_s: float
    read_model: str
    table: tuple[Row, ...] = attrs.field(repr=False)
    tokens: int | None = None  # the prompt length the choice was made for
    extra_bytes: int = 0  # the request's memory beyond the profile's, in memory_bytes
    read_margin: float = 0.0  # reads ranked 1 + read_margin times as long as profiled
    slow_reads_s: float = 0.0  # predicted_s with those slower reads

    def to_dict(self) -> dict[str, Any]:
        """The manifest's ``config`` entry."""
        return {
            "G": self.G,
            "Q": self.Q,
            "B": self.B,
            "budget_bytes": self.budget_bytes,
            "predicted_s": self.predicted_s,
            "memory_bytes": self.memory_bytes,
            "per_layer_s": self.per_layer_s,
            "read_model": self.read_model,
            "tokens": self.tokens,
            "extra_bytes": self.extra_bytes,
            "read_margin": self.read_margin,
            "slow_reads_s": self.slow_reads_s,
        }


@attrs.frozen
class _GroupModel:
    L: NDArray[np.float64]  # [W, Kmax] scheduled groups only, zero-padded at the end
    X: NDArray[np.float64]
    t_ne: NDArray[np.float64]  # [W]
    k_max: int


def calibration_tokens(profile: Profile) -> int:
    """The prompt length the profile's calibration request had (``meta["tokens"]``)."""
    t = profile.meta.get("tokens")
    if not isinstance(t, int) or isinstance(t, bool) or t < 1:
        raise ProfileError(
            "meta.tokens",
            "the calibration prompt length is not recorded (profiles from `estream profile` "
            "record it); configure without tokens, or re-profile",
        )
    return t


def route_slope(runs: Sequence[tuple[NDArray[Any], NDArray[Any]]]) -> float:
    """The seconds one route adds to a group's execution: the common slope ``c`` of
    ``X ≈ a_i + c · routes`` over the routed groups of every run ``i`` (``(routes, execs)``
    pairs, one per calibration run), each run with its own intercept ``a_i`` (its fixed cost
    per op). 0.0 when no run has two routed groups with different route counts.

    Why one slope: the per-route work (a token through one expert's projections) is the same
    whatever ``g`` groups the experts, and every ``g`` routes the same total. Slopes fitted per
    ``g`` differ by noise alone (a run of 16-expert groups has four groups a layer, with alike
    route counts), and that noise, multiplied by the routes of a longer prompt, decided ``G``:
    on OLMoE shapes per-``g`` slopes 3.4e-5 (``g=2``) and 4.7e-5 s/route (``g=16``) put 1.3 s
    between the two at 1K tokens that were not there (measured ``g=16`` 3 % faster)."""
    num = den = 0.0
    for routes, execs in runs:
        r = np.asarray(routes, dtype=np.float64).reshape(-1)
        y = np.asarray(execs, dtype=np.float64).reshape(-1)
        routed = r > 0
        x, y = r[routed], y[routed]
        if x.size < 2:
            continue
        xc = x - x.mean()
        num += float(np.dot(xc, y - y.mean()))
        den += float(np.dot(xc, xc))
    return num / den if den > 0 else 0.0


def scaled_exec_times(
    routes: NDArray[Any], execs: NDArray[Any], scale: float, slope: float | None = None
) -> NDArray[Any]:
    """Group execution times for a request ``scale`` times the calibration prompt (module
    docstring): ``X_k + c · routes_k · (scale - 1)`` with ``c = slope``, by default the
    least-squares slope of ``X ≈ a + c · routes`` over these routed groups (`route_slope` of
    this one run), or ``X_k · scale`` if that slope is not positive. Unrouted groups stay 0
    (they are not scheduled)."""
    execs = np.asarray(execs, dtype=np.float64)
    if scale == 1.0:
        return execs
    r = np.asarray(routes, dtype=np.float64)
    routed = r > 0
    if slope is None:
        slope = route_slope([(r, execs)])
    if slope > 0.0:
        out = np.where(routed, execs + slope * r * (scale - 1.0), 0.0)
    else:
        out = np.where(routed, execs * scale, 0.0)
    return np.maximum(out, 0.0)


def model_arrays(
    profile: Profile,
    q: int,
    read_model: ReadModel = "calibrated",
    tokens: int | None = None,
    read_scale: float = 1.0,
) -> dict[int, _GroupModel]:
    """Per ``g``: ``L``, ``X`` (``[W, K_max]``) and pooled ``t_ne`` (``[W]``) at queue depth ``q``,
    for a request of ``tokens`` tokens (default: the calibration prompt's length), every read
    ``read_scale`` times as long as the read model says (the configurator's margin).

    Cached on the profile (it is budget independent)."""
    t_scale = 1.0 if tokens is None else int(tokens) / calibration_tokens(profile)
    if t_scale <= 0:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    read_scale = float(read_scale)
    if not (np.isfinite(read_scale) and read_scale > 0):
        raise ValueError(f"read_scale must be a positive number, got {read_scale}")
    key = ("model", q, read_model, t_scale, read_scale)
    hit = profile._cache.get(key)
    if hit is not None:
        return hit  # type: ignore[no-any-return]
    if read_model not in _READ_MODELS:
        raise ValueError(f"read_model must be one of {_READ_MODELS}, got {read_model!r}")
    qm = profile.q_measured
    gs = profile.groups
    t_ne = t_scale * np.mean(
        np.array([[lp.t_ne for lp in profile.candidates[g]] for g in gs], dtype=np.float64), axis=0
    )
    out: dict[int, _GroupModel] = {}
    slope = None
    if t_scale != 1.0:  # one per-route cost for every g (route_slope)
        slope = route_slope(
            [
                (
                    np.stack([lp.routes for lp in profile.candidates[g]]),
                    np.stack([lp.exec_times for lp in profile.candidates[g]]),
                )
                for g in gs
            ]
        )
    for g in gs:
        bw = profile.bandwidth[g]
        if q not in bw:
            raise ValueError(
                f"queue depth q={q} was not measured for g={g} (measured: {sorted(bw)})"
            )
        layers = profile.candidates[g]
        routes = np.stack([lp.routes for lp in layers])
        nbytes = np.stack([lp.group_bytes for lp in layers]).astype(np.float64)
        reads = np.stack([lp.read_times for lp in layers])
        execs = scaled_exec_times(
            routes, np.stack([lp.exec_times for lp in layers]), t_scale, slope
        )
        routed = routes > 0
        scale = (q / bw[q]) / (qm / bw[qm])
        if read_model == "bandwidth":
            L = nbytes * (q / bw[q])
        elif read_model == "measured":
            L = reads * scale
        else:
            # Pooled over the routed groups of every layer: seconds per byte at q_measured.
            sel_bytes = float(nbytes[routed].sum())
            lam = float(reads[routed].sum()) / sel_bytes if sel_bytes > 0 else 0.0
            L = nbytes * lam * scale
        L = L * read_scale
        # Compact each layer's routed groups to the front (stable), zero the tail.
        W = routes.shape[0]
        counts = routed.sum(axis=1)
        k_max = int(counts.max()) if W else 0
        order = np.argsort(~routed, axis=1, kind="stable")[:, :k_max]
        live = np.arange(k_max)[None, :] < counts[:, None]
        Lp = np.where(live, np.take_along_axis(L, order, axis=1), 0.0)
        Xp = np.where(live, np.take_along_axis(execs, order, axis=1), 0.0)
        out[g] = _GroupModel(L=Lp, X=Xp, t_ne=t_ne, k_max=k_max)
    profile._cache[key] = out
    return out


def _memory(profile: Profile, g: int, b: int | NDArray[np.int64], extra: int = 0) -> Any:
    return profile.m_other[g] + extra + b * g * profile.expert_bytes


def sweep(
    profile: Profile,
    *,
    q: int | None = None,
    read_model: ReadModel = "calibrated",
    tokens: int | None = None,
    schedule: ScheduleName = "early",
    routes_at_layer_start: bool = False,
    read_scale: float = 1.0,
) -> dict[int, tuple[NDArray[np.int64], NDArray[np.float64]]]:
    """Mean per-layer ``T_pipe`` for every ``g`` and every ``b`` in ``q..ceil(N_e/g)``, reads
    released as ``schedule`` and ``routes_at_layer_start`` say (module docstring) and each
    ``read_scale`` times as long as the read model's (`model_arrays`).

    Returns ``{g: (b_values, mean_T_pipe)}``. Bank counts ``b >= K_max`` (the most groups any
    calibration layer schedules) cannot bind (``f_{k-b}`` is then ``f_{<=0} = 0``), so they are
    evaluated once and repeated.
    """
    q0 = choose_q0(profile.bandwidth) if q is None else int(q)
    if q0 < 1:
        raise ValueError(f"q must be >= 1, got {q0}")
    wait = reads_wait_for_attention(schedule, routes_at_layer_start)
    # budget-independent: once per profile, depth, read scale
    key = ("sweep", q0, read_model, tokens, wait, float(read_scale))
    hit = profile._cache.get(key)
    if hit is not None:
        return dict(hit)  # type: ignore[arg-type]
    models = model_arrays(profile, q0, read_model, tokens, read_scale)
    out: dict[int, tuple[NDArray[np.int64], NDArray[np.float64]]] = {}
    for g in profile.groups:
        b_top = n_groups(profile.n_experts, g)
        if b_top < q0:
            continue
        m = models[g]
        b_hi = max(q0, min(b_top, m.k_max))
        t_read = m.t_ne if wait else None
        f = sweep_banks(m.L, m.X, m.t_ne, q0, q0, b_hi, t_read)  # [W, b_hi - q0 + 1]
        mean = f.mean(axis=0)
        if b_top > b_hi:
            mean = np.concatenate([mean, np.full(b_top - b_hi, mean[-1])])
        bs = np.arange(q0, b_top + 1, dtype=np.int64)
        bs.setflags(write=False), mean.setflags(write=False)  # shared by every later call
        out[g] = (bs, mean)
    profile._cache[key] = out
    return out


QRule = Literal["model", "pooled", "every-g"]
_Q_RULES = ("model", "pooled", "every-g")


def _configure_at(
    profile: Profile,
    budget: int,
    Q: int,
    read_model: ReadModel,
    tokens: int | None,
    schedule: ScheduleName,
    routes_at_layer_start: bool,
    extra: int,
    read_scale: float,
) -> tuple[list[Row], tuple[float, float, int, int, int] | None, dict[int, Any]]:
    """Every ``(g, b)`` at queue depth ``Q``: the table rows and the best feasible
    ``(slow-reads value, value, memory, g, b)`` (None if none fits)."""

    def at(scale: float) -> dict[int, Any]:
        return sweep(
            profile,
            q=Q,
            read_model=read_model,
            tokens=tokens,
            schedule=schedule,
            routes_at_layer_start=routes_at_layer_start,
            read_scale=scale,
        )

    sw = at(1.0)
    slow_sw = sw if read_scale == 1.0 else at(read_scale)
    W_e = profile.expert_bytes
    nl = profile.n_layers
    rows: list[Row] = []
    best: tuple[float, float, int, int, int] | None = None
    for g, (bs, mean) in sw.items():
        slow = slow_sw[g][1]
        b_max = min((budget - profile.m_other[g] - extra) // (g * W_e), int(bs[-1]))
        for b, v, vs in zip(bs.tolist(), mean.tolist(), slow.tolist()):
            mem = _memory(profile, g, b, extra)
            rows.append(
                Row(
                    g=g,
                    b=b,
                    q=Q,
                    predicted_s=nl * v,
                    memory_bytes=mem,
                    feasible=b <= b_max,
                    per_layer_s=v,
                    slow_reads_s=nl * vs,
                )
            )
        if b_max < Q:
            continue
        n = b_max - Q + 1
        # by the slow-reads time, then the time as profiled, then the fewest banks
        j = int(np.lexsort((np.arange(n), mean[:n], slow[:n]))[0])
        cand = (float(slow[j]), float(mean[j]), _memory(profile, g, Q + j, extra), g, Q + j)
        if best is None or cand < best:
            best = cand
    return rows, best, sw


def _depths(profile: Profile, q0: int | None, q_rule: QRule) -> list[int]:
    """The queue depths `configure` considers: ``q0``, every depth measured for every ``g``
    (rule "model"), or the rule's ``Q0``."""
    if q0 is not None:
        return [int(q0)]
    if q_rule == "model":
        gs = sorted(profile.bandwidth)
        depths = sorted(set.intersection(*[set(profile.bandwidth[g]) for g in gs]))
        if not depths:
            raise ProfileError("bandwidth", "no queue depth was measured for every g")
        return depths
    return [choose_q0(profile.bandwidth, rule=q_rule)]


def _below_minimum(
    profile: Profile, budget: int, sweeps: dict[int, dict[int, Any]], extra: int
) -> BudgetError:
    """The error for a budget no configuration fits: the smallest one's memory (at the
    shallowest depth, ``B = Q``)."""
    Q = min(sweeps)
    g_min = min(sweeps[Q], key=lambda g: (_memory(profile, g, Q), g))
    minimum = _memory(profile, g_min, Q, extra)
    of_it = f"; {format_bytes(extra)} of it beyond the calibration request's" if extra else ""
    return BudgetError(
        f"budget {format_bytes(budget)} ({budget} B) is below the minimum "
        f"{format_bytes(minimum)} ({minimum} B) (G={g_min}, Q={Q}, B={Q}{of_it}); "
        f"raise the budget to at least {minimum} bytes",
        budget_bytes=budget,
        minimum_bytes=minimum,
        g=g_min,
        q=Q,
        b=Q,
    )


def configure(
    profile: Profile,
    budget_bytes: int,
    *,
    q0: int | None = None,
    q_rule: QRule = "model",
    read_model: ReadModel = "calibrated",
    tokens: int | None = None,
    schedule: ScheduleName = "early",
    routes_at_layer_start: bool = False,
    extra_bytes: int | None = None,
    read_margin: float = DEFAULT_READ_MARGIN,
) -> Choice:
    # long: half of it is the docstring of the configurator's options
    """Choose ``(G, Q, B)`` for a process-memory budget (bytes).

    ``schedule`` (``"early"`` or ``"after-routing"``) and ``routes_at_layer_start`` (the
    architecture's router reads the layer's input, before attention): when the layer's reads
    may start (module docstring). ``after-routing`` without it waits for ``T_ne``.

    ``tokens``: the prompt length to configure for (module docstring: the groups' execution
    times and ``T_ne`` are scaled from the calibration prompt's); default the calibration
    length. At long prompts compute outweighs reads, and fewer, larger groups save the per-op
    fixed costs that a short calibration prompt hides behind its reads.

    ``extra_bytes``: memory the request needs beyond what the calibration request measured
    (``M_other(g)``), the same for every configuration: a longer prompt's activations. It is
    part of every candidate's ``memory_bytes``, of the budget test and of the minimum a
    `BudgetError` gives (``Choice.extra_bytes`` records it). Default: ``m_per_token`` for each
    of the request's ``tokens`` beyond the calibration prompt's, where the profile records it
    (else 0).

    ``q_rule="model"`` (default): every queue depth ``q`` the bandwidth table holds for every
    ``g`` is a candidate, and the model decides it like ``g`` and ``b``: a read at depth ``q``
    takes ``bytes · q / BW(g, q)`` (``q`` reads share the disk), so a deeper queue pays in
    latency what it does not win in bandwidth. The pipeline time is minimised over
    ``(g, q, b)``; ties go to the smaller memory, then the smaller ``q``, ``g``.
    ``q_rule="pooled"`` / ``"every-g"``: ``Q = Q0`` from `choose_q0` of the bandwidth table
    first (design §6), then ``(g, b)`` at that depth. ``q0`` fixes ``Q`` (any rule).

    At a depth ``Q``: ``B_max(g) = min(floor((budget - M_other(g) - extra) / (g W_e)), ceil(N_e / g))``;
    ``B*(g) = argmin_{Q <= b <= B_max(g)} mean_w T_pipe``; ``G* = argmin_g`` over ``g`` with
    ``B_max(g) >= Q``. ``predicted_s`` is ``n_layers ×`` the mean per-layer ``T_pipe`` (the MoE
    layers of one calibration-sized request). Raises :class:`BudgetError` (with
    ``.minimum_bytes``) when no configuration fits.

    ``read_margin`` (default `DEFAULT_READ_MARGIN`, 0 to ``MAX_READ_MARGIN``): the minimum above
    is taken over ``slow_reads_s``, the predicted time with every read ``1 + read_margin`` times
    as long as profiled, ties by ``predicted_s`` (module docstring); 0 ranks by ``predicted_s``
    alone. ``predicted_s`` and ``per_layer_s`` stay the predictions at the profiled reads.
    """
    if q_rule not in _Q_RULES:
        raise ValueError(f"q_rule must be one of {_Q_RULES}, got {q_rule!r}")
    reads_wait_for_attention(schedule, routes_at_layer_start)  # validates the schedule
    budget = int(budget_bytes)
    if tokens is not None:
        tokens = int(tokens)
        if tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {tokens}")
    if extra_bytes is not None:
        extra = int(extra_bytes)
    elif tokens is not None and profile.m_per_token is not None:
        extra = max(0, tokens - calibration_tokens(profile)) * profile.m_per_token
    else:
        extra = 0
    if extra < 0:
        raise ValueError(f"extra_bytes must be >= 0, got {extra}")
    margin = check_read_margin(read_margin)
    if tokens is not None and tokens == calibration_tokens(profile):
        tokens = None  # the measured times as they are (one cache entry)
    depths = _depths(profile, q0, q_rule)
    rows: list[Row] = []
    # (slow-reads value, value, memory, q, g, b)
    best: tuple[float, float, int, int, int, int] | None = None
    sweeps: dict[int, dict[int, Any]] = {}
    for Q in depths:
        r, b_at, sw = _configure_at(
            profile,
            budget,
            Q,
            read_model,
            tokens,
            schedule,
            routes_at_layer_start,
            extra,
            1.0 + margin,
        )
        rows += r
        if sw:
            sweeps[Q] = sw
        if b_at is not None:
            cand = (b_at[0], b_at[1], b_at[2], Q, b_at[3], b_at[4])
            if best is None or cand < best:
                best = cand
    if not sweeps:
        raise ProfileError(
            "candidates",
            f"no candidate group size g splits the {profile.n_experts} experts into at least "
            f"Q={depths[0]} groups (ceil(n_experts/g) >= Q is needed to keep Q reads in "
            "flight); profile a smaller g or pass a smaller q0",
        )
    if best is None:
        raise _below_minimum(profile, budget, sweeps, extra)
    vs, v, mem, Q, g, b = best
    nl = profile.n_layers
    return Choice(
        G=g,
        Q=Q,
        B=b,
        predicted_s=nl * v,
        memory_bytes=mem,
        budget_bytes=budget,
        per_layer_s=v,
        read_model=read_model,
        table=tuple(rows),
        tokens=tokens if tokens is not None else profile.meta.get("tokens"),
        extra_bytes=extra,
        read_margin=margin,
        slow_reads_s=nl * vs,
    )
