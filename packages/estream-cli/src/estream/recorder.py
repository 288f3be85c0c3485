"""What a forward pass records besides its math: spans, per-op times, the backend's queue and
progress, turned into the pass's metrics and trace events when it ends.

The engine's layer loop calls one `PassRecorder` at its stage boundaries (`begin_layer`,
`end_layer`, `begin_head`, `finish`) and nothing else; the ops time their kernel calls
themselves (`Ops.timed`) and the recorder collects those spans at each boundary.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import estream_htp as htp

from .experts import ExpertSource
from .metrics import build_events, op_times, run_metrics
from .models.ops import Ops
from .opstats import op_table

__all__ = ["PassRecorder"]

#: (name, layer or -1, start, end) in `time.perf_counter` seconds.
Span = tuple[str, int, float, float]


class PassRecorder:
    """The bookkeeping of one pass of `ops` over `experts` on `backend`. Made when the pass
    starts: from then on the backend records its queue (`estream_htp.Backend.trace`) and
    counts its ops afresh. ``mem_before``: available memory before the engine loaded (for the
    peak-memory metrics); ``progress``: a layer counter on stderr when it is a terminal."""

    def __init__(
        self,
        ops: Ops,
        experts: ExpertSource,
        backend: htp.Backend,
        *,
        n_layers: int,
        mem_before: int,
        progress: bool = False,
    ) -> None:
        self.ops, self.experts, self.backend = ops, experts, backend
        self.n_layers = n_layers
        self.mem_before = mem_before
        self.show = progress and sys.stderr.isatty()
        self.spans: list[Span] = []  # per layer: "non-expert" parts and the whole "layer"
        self.op_spans: list[Span] = []  # every timed op, with its layer (-1: embedding, head)
        self.op_work: list[tuple[str, int, str, int]] = []  # (op, layer, precision, operations)
        backend.trace = []  # every op the backend ran through a fence, with its times
        backend.reset_stats()
        self.t_start = time.perf_counter()
        self._t0 = self.t_start

    def _collect(self, layer: int) -> None:
        self.op_spans += [(name, layer, s0, s1) for name, s0, s1 in self.ops.op_spans]
        self.ops.op_spans.clear()
        if self.ops.op_work:
            self.op_work += [(name, layer, p, n) for name, p, n in self.ops.op_work]
            self.ops.op_work.clear()

    def begin_layer(self, i: int) -> None:
        """Layer ``i`` starts (the embedding's ops, before the first, are the pass's)."""
        self._collect(-1)
        self._t0 = time.perf_counter()

    def end_layer(self, i: int) -> None:
        """Layer ``i`` ended: its span, its parts outside the routed-expert phases, its ops."""
        t0, t1 = self._t0, time.perf_counter()
        phases = [(s0, s1) for name, s0, s1 in self.ops.op_spans if name == "experts"]
        self.spans += _non_expert_spans(i, t0, t1, phases)
        self._collect(i)
        self.spans.append(("layer", i, t0, t1))
        if self.show:
            print(f"\r  layer {i + 1}/{self.n_layers}", end="", file=sys.stderr, flush=True)

    def begin_head(self) -> None:
        """The final norm and output head start."""
        if self.show:
            print("\r" + " " * 24 + "\r", end="", file=sys.stderr, flush=True)
        self._collect(-1)
        self._t0 = time.perf_counter()

    def finish(
        self, describe: Callable[[], dict[str, Any]]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The pass ended: its metrics (with ``describe()``, the engine's description of the
        run, called once the pass's clock has stopped) and the extras of a result (trace
        events, group records, reads)."""
        t_end = time.perf_counter()
        self.spans.append(("output", -1, self._t0, t_end))
        self._collect(-1)
        records = list(self.experts.records)
        reads = self.experts.reads()
        metrics = run_metrics(
            t_start=self.t_start,
            t_end=t_end,
            spans=self.spans,
            records=records,
            reads=reads,
            bytes_read=self.experts.bytes_read,
            mem_before=self.mem_before,
        )
        metrics.update(describe())
        t_ne = [0.0] * self.n_layers  # non-expert time of every layer (dense layers included)
        for name, layer, s0, s1 in self.spans:
            if name == "non-expert":
                t_ne[layer] += s1 - s0
        metrics["layer_t_ne_s"] = t_ne
        metrics["op_time_s"] = op_times(self.op_spans)
        if self.ops.op_work is not None:  # per-op work counted: the per-op table
            metrics["op_table"] = op_table(
                total_s=metrics["ttft_s"], n_layers=self.n_layers, op_spans=self.op_spans,
                op_work=self.op_work, records=records,
            )  # fmt: skip
        be = self.backend
        queue, be.trace = be.trace or [], None
        metrics.update({f"backend_{k}": v for k, v in be.stats().items()})
        if self.ops.pool is not None:
            metrics["activation_pool_bytes"] = self.ops.pool.nbytes
        events = build_events(self.t_start, self.spans, records, reads, self.op_spans, queue)
        return metrics, {"events": events, "records": records, "reads": list(reads)}


def _non_expert_spans(
    layer: int, t0: float, t1: float, expert_phases: list[tuple[float, float]]
) -> list[Span]:
    """The parts of a layer's time `[t0, t1]` outside its routed-expert phases."""
    out = []
    start = t0
    for p0, p1 in expert_phases:
        out.append(("non-expert", layer, start, p0))
        start = p1
    out.append(("non-expert", layer, start, t1))
    return out
