"""Pipeline metrics: bubble rate, I/O–compute overlap, latency–memory Pareto frontier."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ._model import Schedule

__all__ = [
    "bubble_rate",
    "busy_time",
    "overlap",
    "pareto_frontier",
    "schedule_metrics",
    "union",
]

Interval = tuple[float, float]


def bubble_rate(t_io: float, t_exec: float, t_total: float) -> float:
    """``1 − max(T_io, T_exec) / T_total``: the share of the run neither stage could fill.

    ``T_io`` and ``T_exec`` are busy times (see :func:`busy_time`) of the loader and of the
    executor (non-expert plus expert compute). 0 for a perfectly balanced, gap-free pipeline.
    """
    if t_total <= 0:
        raise ValueError(f"t_total must be > 0, got {t_total}")
    if t_io < 0 or t_exec < 0:
        raise ValueError("busy times must be >= 0")
    return 1.0 - max(t_io, t_exec) / t_total


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint union of half-open intervals ``[start, end)`` (empty ones dropped)."""
    iv = sorted((float(a), float(b)) for a, b in intervals if b > a)
    out: list[Interval] = []
    for a, b in iv:
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def busy_time(intervals: Iterable[Interval]) -> float:
    """Length of the union of the intervals (overlapping reads count once)."""
    return sum(b - a for a, b in union(intervals))


def overlap(read_intervals: Iterable[Interval], exec_intervals: Iterable[Interval]) -> float:
    """Fraction of read (busy) time hidden behind compute: ``|R ∩ C| / |R|``.

    ``R`` and ``C`` are the unions of the read and compute intervals. Returns 1.0 when there was
    no read time at all (nothing was exposed).
    """
    R = union(read_intervals)
    C = union(exec_intervals)
    total = sum(b - a for a, b in R)
    if total <= 0:
        return 1.0
    hidden = 0.0
    i = j = 0
    while i < len(R) and j < len(C):
        lo = max(R[i][0], C[j][0])
        hi = min(R[i][1], C[j][1])
        if hi > lo:
            hidden += hi - lo
        if R[i][1] < C[j][1]:
            i += 1
        else:
            j += 1
    return hidden / total


def pareto_frontier(points: ArrayLike | Sequence[Sequence[float]]) -> NDArray[np.int64]:
    """Indices of the non-dominated ``(memory, latency)`` points, by increasing memory.

    A point is kept when no other point has memory <= and latency <= with one strictly less;
    among exact duplicates the first is kept. Latency strictly decreases along the result.
    """
    P = np.asarray(points, dtype=np.float64)
    if P.size == 0:
        return np.zeros(0, dtype=np.int64)
    if P.ndim != 2 or P.shape[1] != 2:
        raise ValueError(f"points must be (memory, latency) pairs, got shape {P.shape}")
    order = np.lexsort((np.arange(len(P)), P[:, 1], P[:, 0]))  # memory, then latency, then index
    keep: list[int] = []
    best = np.inf
    for i in order:
        if P[i, 1] < best:
            keep.append(int(i))
            best = P[i, 1]
    return np.asarray(keep, dtype=np.int64)


def schedule_metrics(schedule: Schedule, *, start_s: float = 0.0) -> dict[str, float]:
    """``t_io``, ``t_exec``, ``t_total``, ``bubble_rate`` and ``overlap`` of a one-layer schedule.

    The executor is busy with non-expert work over ``[start_s, t_ne)`` and with group ``k`` over
    ``[s_k, f_k)``; the loader over the union of ``[a_k, d_k)``. ``start_s`` is the layer start
    (non-zero for the absolute-time schedules of ``simulate_layers``).
    """
    if schedule.f.ndim != 1:
        raise ValueError("schedule_metrics needs a single-candidate schedule (1-D arrays)")
    t_ne = float(schedule.t_ne)
    reads = list(zip(schedule.a.tolist(), schedule.d.tolist()))
    execs = [(start_s, t_ne), *zip(schedule.s.tolist(), schedule.f.tolist())]
    t_io = busy_time(reads)
    t_exec = busy_time(execs)
    t_total = float(schedule.total) - start_s
    return {
        "t_io": t_io,
        "t_exec": t_exec,
        "t_total": t_total,
        "bubble_rate": bubble_rate(t_io, t_exec, t_total) if t_total > 0 else 0.0,
        "overlap": overlap(reads, execs),
    }
