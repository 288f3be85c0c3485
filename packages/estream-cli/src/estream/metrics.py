"""Metrics and timeline events of one prefill, computed with estream-sched's definitions.

* TTFT: tokens in → logits out, model already loaded.
* I/O–compute overlap: the fraction of read time during which some compute ran.
* Reads of the pass that ran before it started (the streamed source starts the first MoE
  layer's reads while the model loads) count in ``bytes_read`` and, as
  ``bytes_read_before_pass``, separately; the busy times and the overlap see only the part of
  each read inside the pass.
* Bubble rate: 1 − max(T_io, T_exec) / T_total (docs/design.md §6), where T_io is the union of read
  intervals and T_exec the union of compute intervals.
* Time by op: the summed duration of each kind of kernel call (q/k/v projections, attention,
  routed experts, output head, norms, ...), from the per-op spans the forward pass records.
* Backend queue ("dsp queue"): when each op waited for through a fence was submitted, started
  and completed — every op in the executor process of an executor backend, the expert ops on
  the host —, from the times the backend returns with each completion.
"""

from __future__ import annotations

from typing import Any

import estream_sched as es

from . import memory

__all__ = ["build_events", "op_times", "run_metrics"]


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
    io = [(max(r.t_start, t_start), min(r.t_end, t_end)) for r in reads if r.t_end > t_start]
    early = sum(r.nbytes for r in reads if r.t_end <= t_start and r.outcome != "failed")
    t_exec = es.busy_time(comp)
    t_io = es.busy_time(io)
    stall = sum(max(0.0, r.t_start - r.t_wait) for r in records)
    peak = memory.peak_rss()
    drop = max(0, mem_before - memory.mem_available()) if mem_before else 0
    return {
        "ttft_s": total,
        "t_exec_s": t_exec,
        "t_io_s": t_io,
        "expert_stall_s": stall,
        "bytes_read": int(bytes_read),
        "bytes_read_before_pass": int(early),
        "io_compute_overlap": es.overlap(io, comp),
        "bubble_rate": es.bubble_rate(t_io, t_exec, total) if total > 0 else 0.0,
        "peak_rss_bytes": int(peak),
        "mem_available_drop_bytes": int(drop),
        "peak_memory_bytes": int(max(peak, drop)),
        "groups_executed": len(records),
    }


def op_times(op_spans: list) -> dict[str, float]:
    """Total seconds per op over ``(op, layer, start, end)`` spans, largest first."""
    tot: dict[str, float] = {}
    for name, _, t0, t1 in op_spans:
        tot[name] = tot.get(name, 0.0) + (t1 - t0)
    return dict(sorted(tot.items(), key=lambda kv: -kv[1]))


def build_events(
    t0: float,
    spans: list,
    records: list,
    reads: list,
    op_spans: list | None = None,
    dsp_ops: list | None = None,
) -> list[es.TraceEvent]:
    """Timeline events (seconds from the start of the prefill) for Chrome trace export; the
    per-op spans go on their own track ("ops") under the layer spans. ``dsp_ops``: the
    executor's queue, ``(op, submitted, started, completed)`` per op in the host's clock
    (`estream_htp.Backend.trace`): one event per op on the "dsp queue" track from start to
    completion (its submission time in ``args``), and the time it waited in the queue
    (submission to start) on "dsp queue (waiting)"."""
    ev: list[es.TraceEvent] = []
    for i, (name, sub, start, end) in enumerate(dsp_ops or ()):
        args = {"seq": i, "submitted_s": sub - t0, "queued_us": (start - sub) * 1e6}
        ev.append(es.TraceEvent(name, "dsp queue", start - t0, end - t0, "dsp", args=args))
        ev.append(
            es.TraceEvent(name, "dsp queue (waiting)", sub - t0, start - t0, "dsp-wait",
                          args={"seq": i})
        )  # fmt: skip
    for name, layer, s, e in op_spans or ():
        label = name if layer < 0 else f"{name} L{layer}"
        ev.append(es.TraceEvent(label, "ops", s - t0, e - t0, "op", args={"layer": layer}))
    for name, layer, s, e in spans:
        if name == "layer":
            continue
        label = name if layer < 0 else f"{name} L{layer}"
        ev.append(es.TraceEvent(label, "compute", s - t0, e - t0, name, args={"layer": layer}))
    for r in records:
        args = {"layer": r.layer, "group": r.group, "routes": r.n_routes}
        ev.append(
            es.TraceEvent(
                f"experts L{r.layer} g{r.group}", "compute", r.t_start - t0, r.t_end - t0,
                "expert", args=args,
            )
        )  # fmt: skip
        if r.t_start - r.t_wait > 1e-6:
            ev.append(
                es.TraceEvent(
                    "wait", "stall", r.t_wait - t0, r.t_start - t0, "stall",
                    args={"layer": r.layer, "group": r.group},
                )
            )  # fmt: skip
    for r in reads:
        ev.append(
            es.TraceEvent(
                f"read L{r.layer} g{r.group}", f"bank {r.bank}", r.t_start - t0, r.t_end - t0,
                "read",
                args={"layer": r.layer, "group": r.group, "bytes": r.nbytes,
                      "submitted_s": r.t_submit - t0},
            )
        )  # fmt: skip
    return ev
