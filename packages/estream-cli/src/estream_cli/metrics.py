"""Metrics and timeline events of one prefill.

* TTFT: tokens in → logits out, model already loaded.
* I/O–compute overlap: the fraction of read time during which some compute ran.
* Bubble rate: 1 − max(T_io, T_exec) / T_total (DESIGN.md §6), where T_io is the union of read
  intervals and T_exec the union of compute intervals.
"""

from __future__ import annotations

from typing import Any

from . import memory

__all__ = ["build_events", "run_metrics", "union_length"]


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of (∪a) ∩ (∪b)."""
    return union_length(a) + union_length(b) - union_length(a + b)


def _compute_intervals(spans: list, records: list) -> list[tuple[float, float]]:
    out = [(t0, t1) for name, _, t0, t1 in spans if name in ("non-expert", "output")]
    out += [(r.t_start, r.t_end) for r in records]
    return out


def run_metrics(
    *,
    t_start: float,
    t_end: float,
    spans: list,
    records: list,
    reads: list,
    bytes_read: int,
    mem_before: int,
) -> dict[str, Any]:
    total = t_end - t_start
    comp = _compute_intervals(spans, records)
    io = [(r.t_start, r.t_end) for r in reads]
    t_exec = union_length(comp)
    t_io = union_length(io)
    hidden = _intersection(io, comp)
    stall = sum(max(0.0, r.t_start - r.t_wait) for r in records)
    peak = memory.peak_rss()
    drop = max(0, mem_before - memory.mem_available()) if mem_before else 0
    return {
        "ttft_s": total,
        "t_exec_s": t_exec,
        "t_io_s": t_io,
        "expert_stall_s": stall,
        "bytes_read": int(bytes_read),
        "io_compute_overlap": (hidden / t_io) if t_io > 0 else 1.0,
        "bubble_rate": (1.0 - max(t_io, t_exec) / total) if total > 0 else 0.0,
        "peak_rss_bytes": int(peak),
        "mem_available_drop_bytes": int(drop),
        "peak_memory_bytes": int(max(peak, drop)),
        "groups_executed": len(records),
    }


def build_events(t0: float, spans: list, records: list, reads: list) -> list[dict[str, Any]]:
    """Timeline events (seconds from the start of the prefill) for Chrome trace export."""
    ev: list[dict[str, Any]] = []
    for name, layer, s, e in spans:
        if name == "layer":
            continue
        ev.append(
            {
                "name": name if layer < 0 else f"{name} L{layer}",
                "track": "compute",
                "start": s - t0,
                "end": e - t0,
                "args": {"layer": layer},
            }
        )
    for r in records:
        ev.append(
            {
                "name": f"experts L{r.layer} g{r.group}",
                "track": "compute",
                "start": r.t_start - t0,
                "end": r.t_end - t0,
                "args": {"layer": r.layer, "group": r.group, "routes": r.n_routes},
            }
        )
        if r.t_start - r.t_wait > 1e-6:
            ev.append(
                {
                    "name": "wait",
                    "track": "stall",
                    "start": r.t_wait - t0,
                    "end": r.t_start - t0,
                    "args": {"layer": r.layer, "group": r.group},
                }
            )
    for r in reads:
        ev.append(
            {
                "name": f"read L{r.layer} g{r.group}",
                "track": f"bank {r.bank}",
                "start": r.t_start - t0,
                "end": r.t_end - t0,
                "args": {"layer": r.layer, "group": r.group, "bytes": r.nbytes},
            }
        )
    return ev
