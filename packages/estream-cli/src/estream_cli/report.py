"""Printing and saving what a run measured: the metrics table and the Chrome trace."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, TextIO

import estream_htp as htp
import estream_sched as es
from estream import memory
from estream.opstats import add_peaks, format_table

from .output import write_output

__all__ = ["print_metrics", "public_metrics", "with_measured_peaks", "write_trace"]

_METRIC_ROWS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("ttft_s", "pure-prefill TTFT", lambda v: f"{v * 1e3:.1f} ms"),
    ("end_to_end_s", "end-to-end (load + prefill)", lambda v: f"{v * 1e3:.1f} ms"),
    ("peak_memory_bytes", "peak memory", memory.format_bytes),
    ("expert_memory_bytes", "expert memory (arena)", memory.format_bytes),
    ("dense_bytes", "dense weights (resident)", memory.format_bytes),
    ("weight_copy_bytes", "weight copies (resident)", memory.format_bytes),
    ("bytes_read", "expert bytes read", memory.format_bytes),
    ("bytes_read_before_pass", "  of which read before the pass began", memory.format_bytes),
    ("io_compute_overlap", "I/O–compute overlap", lambda v: f"{v * 100:.1f} %"),
    ("bubble_rate", "bubble rate", lambda v: f"{v * 100:.1f} %"),
    ("expert_stall_s", "executor waited for reads", lambda v: f"{v * 1e3:.1f} ms"),
]


def print_metrics(m: dict[str, Any], out: TextIO | None = None) -> None:
    out = out or sys.stdout
    cfg = f"mode={m.get('mode')}"
    if "G" in m:
        cfg += f" G={m['G']} Q={m['Q']} B={m['B']} ({m.get('config_source')}) schedule={m.get('schedule')}"
    print(
        f"  {cfg}  tokens={m.get('tokens')}  backend={m.get('backend')}  "
        f"threads={m.get('threads')}  simd={m.get('simd')}  act={m.get('act')}"
        + (f"  attention={m['attention']}" if m.get("attention") else ""),
        file=out,
    )
    for key, label, fmt in _METRIC_ROWS:
        if key in m and m[key] is not None:
            print(f"  {label:<30s} {fmt(m[key])}", file=out)
    ops = m.get("op_time_s")
    if ops:
        total = m.get("ttft_s") or sum(ops.values())
        print(f"  {'time by op':<30s} " + ", ".join(
            f"{k} {v * 1e3:.1f} ms ({100 * v / total:.0f}%)" for k, v in ops.items()
        ), file=out)  # fmt: skip
    table = m.get("op_table")
    if table:
        print('  per-op table (README: "Reading the per-op table"):', file=out)
        for line in format_table(table, indent="    "):
            print(line, file=out)


def with_measured_peaks(table: dict[str, Any], backend: Any) -> dict[str, Any]:
    """The per-op table with each row's share of the peak `estream_htp.measure_peaks` measures
    on ``backend``'s threads (about half a second); unchanged where the backend runs its ops
    in another process or on the DSP, whose rates this process cannot time."""
    peaks = htp.measure_peaks(backend=backend)
    return add_peaks(table, peaks) if any(v is not None for v in peaks.values()) else table


def public_metrics(m: dict[str, Any]) -> dict[str, Any]:
    """The metrics without the engine's internal per-layer figures."""
    return {k: v for k, v in m.items() if k not in ("layer_t_ne_s",)}


def write_trace(path: str, events: list[es.TraceEvent], meta: dict[str, Any]) -> None:
    """Chrome trace-event JSON (Perfetto / chrome://tracing), through the command's one output
    writer (`output.write_output`: atomic, ``-`` for standard output)."""
    doc = es.chrome_trace(events)
    doc["otherData"] = meta
    write_output(path, "--trace", lambda f: f.write(json.dumps(doc).encode()))
