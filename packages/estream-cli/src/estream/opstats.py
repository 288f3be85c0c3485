"""The per-op table of a pass: time, share of the pass, work and achieved rate of each op kind.

With ``EngineOptions(op_stats=True)`` every kernel call of the forward pass also records its
work (`Ops.op_work`): multiply-adds counted from its shapes, times 2 (one multiply and one add
are two operations, as GFLOP/s and int8 GOP/s are usually quoted), and the precision it
multiplies in — ``int8`` (a quantized GEMM or the routed experts under int8 activations),
``fp32`` or ``bf16`` (attention, by its products). The table then holds, per op kind:

* ``time_s``: the summed wall time of its calls (the `Ops.timed` spans, which never nest), and
  ``per_layer_s``: the same per layer (index ``n_layers``: the embedding, final norm and head);
* ``share``: ``time_s`` over the pass's measured time (`ttft_s`);
* ``gop`` and ``gops``: its work (10⁹ operations) and the achieved rate ``gop / time_s``;
* ``pct_of_peak``: that rate as a share of the machine's measured peak of its precision, when
  peaks are given (`add_peaks`; the benchmarks measure them the way bench_kernels does).

An op whose calls multiply in more than one precision (attention with ``bf16-pv`` products:
the scores in fp32, the weighted sum in bf16) has ``precision`` "bf16+fp32", its work per
precision in ``gop_by_precision``, and ``pct_of_peak`` the time its work would take at each
precision's peak over the time it took.

The routed-expert phase is split in two: ``expert_wait``, the time the engine waited for a
group's read (a streamed bank not loaded yet), and ``experts``, the rest of the phase (the
expert FFN compute, with its work ``routes · 3 · d · n_ff_exp`` multiply-adds). ``untimed`` is
what no op accounts for (Python between the ops, layer bookkeeping), so that the rows add up to
the pass's time exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["ROLES", "add_peaks", "attention_macs", "format_table", "op_table"]

#: Op kind -> what it is, for the table's readers (README: "Reading the per-op table").
ROLES: dict[str, str] = {
    "attention": "attention kernel (softmax(q kᵀ) v)",
    "attn_qkv": "GEMM: q/k/v projections",
    "attn_q_kv_a": "GEMM: MLA q (or q LoRA down) and compressed KV",
    "attn_q_b": "GEMM: MLA q LoRA up-projection",
    "attn_kv_b": "GEMM: MLA key/value decompression",
    "attn_out": "GEMM: attention output projection",
    "conv_in": "GEMM: short-conv input projection",
    "conv_out": "GEMM: short-conv output projection",
    "short_conv": "short convolution (gates, depthwise conv)",
    "ffn": "GEMM: dense FFN (leading dense layers)",
    "shared_ffn": "GEMM: shared experts",
    "glu": "gated activation of a dense/shared FFN",
    "output_head": "GEMM: output head (logits)",
    "router": "router (logits, top-k)",
    "experts": "routed expert FFN compute",
    "expert_wait": "waiting for a routed group's read",
    "quantize": "int8 quantization of an FFN input",
    "norm": "RMSNorm",
    "qk_norm": "q/k RMSNorm",
    "rope": "RoPE",
    "embed": "token embedding",
    "untimed": "between ops (Python, layer bookkeeping)",
}


def op_table(
    *,
    total_s: float,
    n_layers: int,
    op_spans: Iterable[tuple[str, int, float, float]],
    op_work: Iterable[tuple[str, int, str, int]],
    records: Iterable[Any] = (),
) -> dict[str, Any]:
    """The per-op table of a pass of ``total_s`` seconds.

    ``op_spans``: ``(op, layer, start, end)`` of every timed call (layer -1: outside the
    layers); ``op_work``: ``(op, layer, precision, operations)`` of every call with work;
    ``records``: the routed groups (`GroupRecord`), whose waits for a read inside an
    ``experts`` span are moved to ``expert_wait``."""
    slot = n_layers  # the embedding, final norm and head
    per_layer: dict[str, list[float]] = {}

    def add(op: str, layer: int, dt: float) -> None:
        per_layer.setdefault(op, [0.0] * (n_layers + 1))[layer if layer >= 0 else slot] += dt

    waits: dict[int, list[tuple[float, float]]] = {}
    for r in records:
        if r.t_start > r.t_wait:
            waits.setdefault(int(r.layer), []).append((float(r.t_wait), float(r.t_start)))
    for op, layer, t0, t1 in op_spans:
        if op == "experts":
            w = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in waits.get(layer, ()) if b > t0)
            add("expert_wait", layer, w)
            add("experts", layer, (t1 - t0) - w)
        else:
            add(op, layer, t1 - t0)
    work: dict[str, dict[str, int]] = {}
    for op, _, prec, n in op_work:
        by = work.setdefault(op, {})
        by[prec] = by.get(prec, 0) + int(n)
    timed = sum(sum(v) for v in per_layer.values())
    untimed = max(0.0, total_s - timed)
    rows = []
    for op, times in per_layer.items():
        t = sum(times)
        by = work.get(op, {})
        prec = "+".join(sorted(by)) or None
        n = sum(by.values())
        row = {
            "op": op,
            "time_s": t,
            "share": t / total_s if total_s > 0 else 0.0,
            "precision": prec,
            "gop": n / 1e9 if prec else None,
            "gops": n / 1e9 / t if prec and t > 0 else None,
        }
        if len(by) > 1:
            row["gop_by_precision"] = {p: v / 1e9 for p, v in sorted(by.items())}
        rows.append(row)
    rows.sort(key=lambda r: -r["time_s"])
    rows.append(
        {
            "op": "untimed",
            "time_s": untimed,
            "share": untimed / total_s if total_s > 0 else 0.0,
            "precision": None,
            "gop": None,
            "gops": None,
        }
    )
    return {
        "total_s": total_s,
        "rows": rows,
        "per_layer_s": {op: v for op, v in per_layer.items()},
    }


def add_peaks(table: dict[str, Any], peaks: dict[str, float | None]) -> dict[str, Any]:
    """``table`` with each row's ``pct_of_peak``: its achieved rate as a percentage of
    ``peaks[precision]`` (GOP/s, 2 per multiply-add; None where there is no such peak; a row of
    several precisions: the time its work takes at their peaks over its time), and the peaks
    themselves under ``peaks_gops``."""
    rows = []
    for r in table["rows"]:
        by = r.get("gop_by_precision") or ({r["precision"]: r["gop"]} if r["precision"] else {})
        pct = None
        if by and r["gop"] is not None and r["time_s"] > 0 and all(peaks.get(p) for p in by):
            floor_s = sum(g / peaks[p] for p, g in by.items())  # type: ignore[operator]
            pct = 100.0 * floor_s / r["time_s"]
        rows.append({**r, "pct_of_peak": pct})
    return {**table, "rows": rows, "peaks_gops": dict(peaks)}


def format_table(table: dict[str, Any], *, indent: str = "  ") -> list[str]:
    """The table as text lines: op, time, share, work, achieved rate, share of peak."""
    peaks = "peaks_gops" in table
    head = (
        f"{indent}{'op':<13s} {'time ms':>9s} {'share':>6s} {'GOP':>9s} {'GOP/s':>8s} {'prec':>5s}"
    )
    lines = [head + (f" {'of peak':>8s}" if peaks else "")]
    for r in table["rows"]:
        line = (
            f"{indent}{r['op']:<13s} {r['time_s'] * 1e3:9.2f} {100 * r['share']:5.1f}%"
            f" {_num(r['gop'], 9, '.3g')} {_num(r['gops'], 8, '.1f')} {r['precision'] or '-':>5s}"
        )
        if peaks:
            pct = r.get("pct_of_peak")
            line += f" {pct:7.1f}%" if pct is not None else f" {'-':>8s}"
        lines.append(line)
    total = sum(r["time_s"] for r in table["rows"])
    lines.append(f"{indent}{'total':<13s} {total * 1e3:9.2f} {100 * total / table['total_s']:5.1f}%"
                 if table["total_s"] > 0 else f"{indent}total 0")  # fmt: skip
    return lines


def _num(v: float | None, width: int, spec: str) -> str:
    return f"{v:{width}{spec}}" if v is not None else f"{'-':>{width}s}"


def attention_macs(
    segments: Sequence[tuple[int, int]], n_head: int, d_k: int, d_v: int, window: int = 0
) -> int:
    """Multiply-adds of causal attention: for each query, ``n_head · (d_k + d_v)`` per visible
    key (the scores and the weighted sum). ``segments``: ``(context, length)`` of each block of
    queries — a sequence's first segment has no context; a continuing one sees its ancestors'
    ``context`` rows, then itself causally; ``window`` > 0 caps the keys a query sees."""
    keys = 0
    for ctx, n in segments:
        # query i sees ctx + i + 1 keys (at most window)
        if window <= 0 or window >= ctx + n:
            keys += n * ctx + n * (n + 1) // 2
        else:
            full = max(0, min(n, window - ctx))  # queries below the cap: ctx + i + 1 <= window
            keys += full * ctx + full * (full + 1) // 2 + (n - full) * window
    return keys * n_head * (d_k + d_v)
