"""docs/benchmarks.md from the latest result of each benchmark in benchmarks/results/, and the
README's headline table (bench_engine at 1K and 4K tokens) between its markers.

    nox -s bench_report            # or: python -m benchmarks.report [--check]

Each benchmark has a renderer here (`BENCHES`): the figures its script writes, as one table.
A result whose 1-minute load average before the run exceeds `LOADED_PER_CORE` per core (1.5 on
a 2-core machine), or after it exceeds that plus one per core (the run's own threads load every
core: 3.5 on 2 cores), is marked as not a result: other work shared its CPUs. The README
headline takes the newest bench_engine result that is not so marked.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: python benchmarks/report.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import record

ROOT = record.ROOT
PAGE = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
RESULTS_SHOWN = record.RESULTS.relative_to(ROOT).as_posix()  # how the page names results
HEADLINE_START = "<!-- bench:headline:start -->"
HEADLINE_END = "<!-- bench:headline:end -->"

#: A run is on a loaded machine when its 1-minute load average exceeds this many per core.
LOADED_PER_CORE = 0.75

Figures = dict[str, Any]


class ReportError(ValueError):
    """Results or a target file the report cannot use, with the reason."""


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]
    notes: list[str] = field(default_factory=list)
    #: Further tables shown after this one and its notes, each under its caption.
    more: list[tuple[str, Table]] = field(default_factory=list)

    def markdown(self) -> list[str]:
        def line(cells: list[str]) -> str:  # a cell's own '|' or line break would split it
            return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"

        return [line(self.headers), "|" + "---|" * len(self.headers), *map(line, self.rows)]


# -- formatting ---------------------------------------------------------------------------------


def num(v: float | None) -> str:
    """Three significant figures, whole numbers from 100 up; '–' for a missing figure."""
    if v is None:
        return "–"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def trim(text: str) -> str:
    """A fixed-point figure without trailing zeros ("13.50" -> "13.5"), so that a figure
    transcribed as 13.5 is not shown as 13.50."""
    return text.rstrip("0").rstrip(".") if "." in text else text


def size(n: float | None) -> str:
    if n is None:
        return "–"
    return trim(f"{n / 2**30:.2f}") + " GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def seconds(values: Iterable[float | None]) -> str:
    """Figures in seconds, joined by ' / ' ('–' for each one missing, or alone if all are)."""
    cells = [num(v) for v in values]
    return "–" if all(c == "–" for c in cells) else " / ".join(cells) + " s"


def prompt(t: int) -> str:
    return f"{t // 1024}K" if t % 1024 == 0 else str(t)


def ttft(run: dict[str, Any] | None) -> str:
    if not run:
        return "–"
    if "ttft_s" not in run:
        return str(run.get("error", "–"))
    return trim(f"{run['ttft_s']:.2f}") + " s"


def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, key: str = "ttft_s") -> str:
    if a and b and a.get(key) and b.get(key):
        return f"{a[key] / b[key]:.3f}"
    return "–"


# -- one renderer per benchmark -----------------------------------------------------------------


def _engine_run(f: Figures, system: str, length: int, cgroup: bool) -> dict[str, Any] | None:
    for r in f["runs"]:
        if r["system"] == system and r["length"] == length and bool(r.get("cgroup")) == cgroup:
            return r
    return None


def _engine_lengths(f: Figures, cgroup: bool) -> list[int]:
    return sorted({r["length"] for r in f["runs"] if bool(r.get("cgroup")) == cgroup})


def render_engine(f: Figures) -> Table:
    t = Table(
        ["prompt", "stream", "resident", "llama.cpp", "stream ÷ resident", "stream ÷ llama.cpp",
         "peak: stream / resident / llama.cpp", "steal: stream / resident", "stream G, Q, B"],
        [],
    )  # fmt: skip
    for T in _engine_lengths(f, False):
        s, r, ll = (_engine_run(f, x, T, False) for x in ("stream", "resident", "llama.cpp"))
        peaks = " / ".join(size((x or {}).get("peak_memory_bytes")) for x in (s, r, ll))
        steal = seconds((x or {}).get("steal_s") for x in (s, r))
        cfg = _gqb(s)
        if s and s.get("pinned_bytes"):
            cfg += f"; {size(s['pinned_bytes'])} pinned"
        t.rows.append(
            [prompt(T), ttft(s), ttft(r), ttft(ll), ratio(s, r), ratio(s, ll), peaks, steal, cfg]
        )
    budget = size(f.get("budget_bytes"))
    for T in _engine_lengths(f, True):
        s, ll = (_engine_run(f, x, T, True) for x in ("stream", "llama.cpp"))
        peaks = " / ".join(size((x or {}).get("peak_memory_bytes")) for x in (s, None, ll))
        steal = seconds([(s or {}).get("steal_s")])
        t.rows.append(
            [f"{prompt(T)} in a {budget} cgroup", ttft(s), "–", ttft(ll), "–", ratio(s, ll),
             peaks, steal, "–"]
        )  # fmt: skip
    t.notes.append(
        f"Time to first token, cold page cache, one fresh process per run; `stream` under the "
        f"configurator's choice for a {budget} budget, {f.get('threads', '–')} threads."
    )
    if any(r.get("pinned_bytes") for r in f["runs"]):
        t.notes.append(
            "`stream` with `--pin`: the experts pinned were read once at load, and each pass "
            "read only the others; the peak includes them."
        )
    if f.get("cgroup_note"):
        t.notes.append(f"Memory-capped runs: {f['cgroup_note']}.")
    if any(r["system"] == IK for r in f["runs"]):
        t.more.append(_ik_table(f))
    if any(r["system"] == IO_TAX for r in f["runs"]):
        t.more.append(_io_tax_table(f))
    if any(r["system"] in READ_CAP for r in f["runs"]):
        t.more.append(_read_cap_table(f))
    if any(r["system"] in PAIRED for r in f["runs"]):
        t.more.append(_pairs_table(f))
    for r in f["runs"]:
        if r.get("op_table"):
            cap = f" in a {budget} cgroup" if r.get("cgroup") else ""
            title = f"Per-op table: `{r['system']}`, {prompt(r['length'])} tokens{cap}"
            t.more.append((f"**{title}** (TTFT {ttft(r)})", _op_table(r["op_table"])))
    if any(r.get("op_table") for r in f["runs"]):
        peaks = f.get("peaks_gops") or {}
        shown = ", ".join(f"{k} {num(v)}" for k, v in peaks.items() if v) or "not measured"
        t.notes.append(
            "Per-op tables (`-- --trace`): each op kind's summed wall time, its share of the "
            "pass, its work (GOP, 2 per multiply-add) and the achieved rate, also as a share of "
            f"the machine's measured peak for its precision (GOP/s: {shown}); `expert_wait` is "
            "time the routed-expert phase waited for reads, `untimed` what no op accounts for."
        )
        if peaks.get("int8_step") and peaks.get("int8"):
            step = peaks["int8_step"] / peaks["int8"]
            t.notes.append(
                f"int8_step: the int8 dot product in the mix of the Q4_0 and Q8_0 kernels with "
                f"their fp32 step per 32-value block ({100 * step:.0f} % of the int8 peak here), the "
                f"ceiling of int8 ops on those formats: such an op's share of it is its share of "
                f"the int8 peak ÷ {step:.2f}."
            )
        over = sorted({o["op"] for r in f["runs"] if r.get("op_table")
                       for o in r["op_table"]["rows"] if (o.get("pct_of_peak") or 0) > 100})  # fmt: skip
        if over:
            t.notes.append(
                "**This result's shares of peak are not results:** "
                + ", ".join(f"`{o}`" for o in over)
                + " ran above 100 % of the peaks measured in the run, so those measurements were "
                "low (the machine was busy, or its time was stolen, while they ran)."
            )
    return t


#: bench_engine's ik_llama.cpp baseline (`--ik-llama-bench`): its runs' system name.
IK = "ik_llama.cpp"


def _tokens_per_s(run: dict[str, Any] | None, length: int) -> str:
    if not run:
        return "–"
    return num(length / run["ttft_s"]) if run.get("ttft_s") else str(run.get("error", "–"))


def _ik_table(f: Figures) -> tuple[str, Table]:
    """bench_engine's free runs in tokens/s beside ik_llama.cpp's llama-bench on the same GGUF,
    and EStream's tokens/s over ik's."""
    t = Table(["prompt", "ik_llama.cpp", "resident", "stream", "resident ÷ ik", "stream ÷ ik",
               "peak: ik_llama.cpp"], [])  # fmt: skip
    for T in _engine_lengths(f, False):
        ik, r, s = (_engine_run(f, x, T, False) for x in (IK, "resident", "stream"))
        t.rows.append(
            [prompt(T), _tokens_per_s(ik, T), _tokens_per_s(r, T), _tokens_per_s(s, T),
             ratio(ik, r), ratio(ik, s), size((ik or {}).get("peak_memory_bytes"))]
        )  # fmt: skip
    info = f.get("ik_llama") or {}
    flags = " ".join(info.get("args") or []) or "its defaults"
    build = info.get("build_commit") or "not recorded"
    caption = (
        f"**ik_llama.cpp on the same GGUF**, prompt tokens/s (`llama-bench -p T -n 0 -r 1 "
        f"-t {f.get('threads', '–')} {flags}`, ik build {build}; the engine's rows from the table above; ÷: EStream's "
        "tokens/s over ik's)"
    )
    return caption, t


#: bench_engine's `resident` runs beside a paced reader (`--io-tax`): their system name.
IO_TAX = "resident+reads"


def _io_tax_table(f: Figures) -> tuple[str, Table]:
    """bench_engine's `--io-tax` runs: `resident` alone, beside reads at the stream run's rate,
    and `stream` against both."""
    t = Table(["prompt", "read rate", "resident", "resident + reads", "(resident + reads) ÷ "
               "resident", "stream", "stream ÷ (resident + reads)"], [])  # fmt: skip
    for T in _engine_lengths(f, False):
        rr, r, s = (_engine_run(f, x, T, False) for x in (IO_TAX, "resident", "stream"))
        rate = (rr or {}).get("background_read_bytes_per_s")
        t.rows.append(
            [prompt(T), f"{size(rate)}/s" if rate else "–", ttft(r), ttft(rr), ratio(rr, r),
             ttft(s), ratio(s, rr)]
        )  # fmt: skip
    caption = (
        "**What the reads alone cost compute** (`-- --io-tax`): `resident` once more while "
        "another process reads the pack's experts file (4 MiB `O_DIRECT` requests) at the "
        "stream run's average read rate (read rate: what it achieved)"
    )
    return caption, t


#: bench_engine's `--read-cap` runs: stream chosen without the configurator's read margin
#: (free), and both choices with their reads capped.
NO_MARGIN, CAPPED, CAPPED_NO_MARGIN = (
    "stream, read margin 0",
    "stream, reads capped",
    "stream, reads capped, read margin 0",
)
READ_CAP = (NO_MARGIN, CAPPED, CAPPED_NO_MARGIN)


#: bench_engine's `--pairs` runs: their system names (each run also has its `pair` index).
PAIRED = ("stream, pair", "resident, pair")


def _pairs(f: Figures, length: int) -> tuple[list[float], dict[str, list[dict[str, Any]]]] | None:
    """bench_engine's `--pairs` at `length`: the pairs' stream ÷ resident ratios (the main
    runs' pair first) and each side's runs with a time; None without pairs."""
    by_length = {row["length"]: row for row in f.get("summary") or []}
    ratios = (by_length.get(length) or {}).get("stream_over_resident_pairs") or []
    if not ratios:
        return None
    runs = {side: [r for r in f["runs"] if not r.get("cgroup") and r["length"] == length
                   and r["system"] in (side, f"{side}, pair") and r.get("ttft_s")]
            for side in ("stream", "resident")}  # fmt: skip
    return ratios, runs


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A run whose time is the median of `runs`' (for the tables' time cells)."""
    return {"ttft_s": statistics.median(r["ttft_s"] for r in runs)} if runs else None


def _pairs_table(f: Figures) -> tuple[str, Table]:
    """bench_engine's `--pairs`: stream ÷ resident over the length's pairs of runs (the main
    runs' and the extra ones'), as the median of the pairs' ratios and their range."""
    t = Table(["prompt", "pairs", "stream (median)", "resident (median)",
               "stream ÷ resident: median [min..max]", "steal: stream / resident"], [])  # fmt: skip
    for T in _engine_lengths(f, False):
        got = _pairs(f, T)
        if got is None:
            continue
        ratios, runs = got
        steal = seconds(
            sum(r.get("steal_s") or 0.0 for r in runs[x]) for x in ("stream", "resident")
        )
        t.rows.append(
            [prompt(T), str(len(ratios)), ttft(_median_run(runs["stream"])),
             ttft(_median_run(runs["resident"])),
             f"{statistics.median(ratios):.3f} [{min(ratios):.3f}..{max(ratios):.3f}]", steal]
        )  # fmt: skip
    caption = (
        "**Stream against resident over pairs of runs** (`-- --pairs N`): the main runs' pair "
        "and N more, alternating which runs first; each pair's stream ÷ resident, their median "
        "and range (a single pair moves with the machine's noise); steal summed over the runs"
    )
    return caption, t


def _gqb(run: dict[str, Any] | None) -> str:
    if not run or not all(k in run for k in "GQB"):
        return "–"
    return ", ".join(str(run[k]) for k in "GQB")


def _read_cap_table(f: Figures) -> tuple[str, Table]:
    """bench_engine's `--read-cap` runs: the budget's configuration chosen with the default
    read margin and without one, at the disk's own speed and with the reads capped."""
    t = Table(["prompt", "disk", "read margin", "G, Q, B", "stream", "waited for reads",
               "stream ÷ resident"], [])  # fmt: skip
    cap = next((r.get("read_cap_bytes_per_s") for r in f["runs"] if r.get("read_cap_bytes_per_s")),
               None)  # fmt: skip
    capped = f"capped at {size(cap)}/s" if cap else "capped"
    default = f"{f.get('read_margin_default', 0.5):g}"  # recorded by bench_engine --read-cap
    for T in _engine_lengths(f, False):
        r = _engine_run(f, "resident", T, False)
        for system, disk, margin in (
            ("stream", "as it is", default), (NO_MARGIN, "as it is", "0"),
            (CAPPED, capped, default), (CAPPED_NO_MARGIN, capped, "0"),
        ):  # fmt: skip
            s = _engine_run(f, system, T, False)
            if s is None:
                continue
            wait = s.get("expert_stall_s")
            t.rows.append(
                [prompt(T), disk, margin, _gqb(s), ttft(s),
                 f"{wait:.2f} s" if wait is not None else "–", ratio(s, r)]
            )  # fmt: skip
    caption = (
        "**A disk slower than profiled** (`-- --read-cap`): the budget's configuration chosen "
        f"with the configurator's default read margin ({default}: reads {1 + float(default):g} "
        "times as long as profiled) and without one (`--read-margin 0`), at the disk's own speed and with the "
        "run's reads capped by a block-I/O cgroup; waited for reads: the engine's "
        "`expert_stall_s`"
    )
    return caption, t


def _op_table(table: dict[str, Any]) -> Table:
    """A run's per-op table (estream's `op_table`, with bench_engine's peaks)."""
    t = Table(["op", "time", "share", "GOP", "GOP/s", "precision", "of peak"], [])
    for r in table["rows"]:
        pct = r.get("pct_of_peak")
        t.rows.append([
            f"`{r['op']}`", trim(f"{r['time_s'] * 1e3:.2f}") + " ms", f"{100 * r['share']:.1f} %",
            num(r.get("gop")), num(r.get("gops")), r.get("precision") or "–",
            f"{pct:.1f} %" if pct is not None else "–",
        ])  # fmt: skip
    return t


def render_tasks(f: Figures) -> Table:
    t = Table(["set (mean tokens)", "system", "req/s cold", "req/s warm", "passes", "peak memory",
               "load average"], [])  # fmt: skip
    for s in f["sets"]:
        n = s["requests"]
        for m in s["runs"]:
            name = f"{s['name']} ({s['mean_tokens']:.1f})"
            if "error" in m:
                t.rows.append([name, m["system"], str(m["error"]), "", "", "", m.get("load", "")])
                continue
            t.rows.append([name, m["system"], num(n / m["wall_s"]), num(n / m["run_s"]),
                           str(m["passes"]), size(m["peak_memory_bytes"]), m.get("load", "")])  # fmt: skip
        for k, v in s.get("ratios", {}).items():
            t.notes.append(f"{s['name']}: `stream-batched` is {v:.2f}× faster than {k}.")
    t.notes.append(f"{f.get('threads', '–')} threads; {f.get('cold', '')}.")
    return t


def render_ray(f: Figures) -> Table:
    t = Table(["system", "rows/s (wall)", "rows/s (run)", "same answers", "load average"], [])
    n = f["rows"]
    for r in f["runs"]:
        if "error" in r:
            t.rows.append([r["system"], str(r["error"]), "", "", r.get("load", "")])
            continue
        same = {True: "yes", False: "**no**"}.get(r.get("same_answers"), "–")
        t.rows.append([r["system"], num(n / r["wall_s"]), num(n / r["run_s"]), same,
                       r.get("load", "")])  # fmt: skip
    if f.get("overhead_one_actor_run") is not None:
        t.notes.append(
            f"Ray at one actor: {100 * f['overhead_one_actor_run']:+.1f} % run time, "
            f"{100 * f['overhead_one_actor_wall']:+.1f} % wall time against the plain command."
        )
    rows = f.get("block_rows")  # none: the command's default, the rows shared between actors
    blocks = f"blocks of {rows} rows" if rows else "the rows shared evenly between the actors"
    t.notes.append(
        f"{n} MASSIVE-shaped rows ({f.get('mean_words', 0):.1f} words, {f.get('labels', '–')} "
        f"labels) on `{f.get('preset', '–')}`, one thread per process or actor, {blocks}; "
        f"{f.get('cold', '')}."
    )
    return t


def render_vs_llama(f: Figures) -> Table:
    t = Table(["side", "tokens/s (median)", "÷ llama-bench (median, range)", "peak RSS"], [])
    for side, s in f["summary"].items():
        over = "–"
        if "over_llama_bench_median" in s:
            lo, hi = s["over_llama_bench_range"]
            med = s["over_llama_bench_median"]
            over = f"{med:.2f} ({lo:.2f}–{hi:.2f})"
        t.rows.append([side, trim(f"{s['tokens_per_s_median']:.1f}"), over,
                       f"{s['peak_rss_mib_median']:.0f} MiB"])  # fmt: skip
    rounds = [len(v) for v in f.get("runs", {}).values()]
    facts = [
        Path(f["gguf"]).name if f.get("gguf") else None,
        f"{f['tokens']} tokens" if f.get("tokens") else None,
        f"{f['threads']} threads" if f.get("threads") else None,
        f"{max(rounds)} rounds" if rounds else None,
        f"llama-bench {f['llama_args']}" if f.get("llama_args") else None,
        f"`stream` under a {size(f['budget_bytes'])} budget" if f.get("budget_bytes") else None,
    ]
    t.notes.append(", ".join(x for x in facts if x) + ".")
    return t


def render_scale(f: Figures) -> Table:
    t = Table(["model", "prompt", "stream TTFT", "tokens/s", "stream peak", "bytes read",
               "overlap", "llama.cpp TTFT", "llama.cpp peak"], [])  # fmt: skip
    for preset, rec in f.get("presets", {}).items():
        runs = rec.get("runs", [])
        for T in sorted({r["length"] for r in runs}):
            s = next((r for r in runs if r["system"] == "stream" and r["length"] == T), {})
            ll = next((r for r in runs if r["system"] == "llama.cpp" and r["length"] == T), None)
            t.rows.append([
                preset, prompt(T), ttft(s), num(T / s["ttft_s"]) if "ttft_s" in s else "–",
                size(s.get("peak_memory_bytes")), size(s.get("bytes_read")),
                f"{s['io_compute_overlap']:.2f}" if "io_compute_overlap" in s else "–",
                ttft(ll), size((ll or {}).get("peak_memory_bytes")),
            ])  # fmt: skip
    t.notes.append("The configurations and the (G, Q, B) sweep are in the result file.")
    return t


def render_kernels(f: Figures) -> Table:
    # runs that measured the int8 dot product in the Q4_0 / Q8_0 kernels' mix get its column
    step = any(r.get("pct_of_best_step") is not None for r in f["rows"])
    t = Table(["op", "htp GFLOP/s", "share of peak", *(["share of int8_step"] if step else []),
               "best BLAS GFLOP/s", "htp ÷ best BLAS"], [])  # fmt: skip
    for r in f["rows"]:
        share = r.get("pct_of_best_peak", r.get("pct_of_peak"))
        of_step = r.get("pct_of_best_step")
        blas = [v for v in (r.get("blas_gflops"), r.get("blas_1thread_gflops")) if v is not None]
        t.rows.append([
            r["op"], num(r["htp_gflops"]),
            f"{share:.0f} % {r['peak_kind']}" if share is not None else "–",
            *([f"{of_step:.0f} %" if of_step is not None else "–"] if step else []),
            num(max(blas)) if blas else "–",
            f"{r['speedup_vs_best_blas']:.1f}×" if r.get("speedup_vs_best_blas") else "–",
        ])  # fmt: skip
    if f.get("peaks_best"):
        peaks = ", ".join(f"{k} {num(v)}" for k, v in f["peaks_best"].items() if v is not None)
        t.notes.append(f"Peaks (better of start and end of the run, GOP/s): {peaks}.")
    if step:
        t.notes.append(
            "int8_step: the int8 dot product in the mix of the Q4_0 and Q8_0 kernels, per 32-row "
            "block and token 16 dot products and the fp32 step of each 16-row half (d_w·d_a, "
            "then acc += dot·that: a multiply and an FMA), its dot products' work only: the "
            "ceiling of those rows where the step's multiplies share the dot product's pipes."
        )
    t.notes.append(
        "BLAS: numpy float32 matmul on the same dequantized weights; the better of 2 and 1 threads."
    )
    return t


def render_arena(f: Figures) -> Table:
    qs = sorted({p["Q"] for p in f["points"]})
    t = Table(["G \\ Q", *[f"Q={q}" for q in qs], "Q0"], [])

    def cells(points: list[dict[str, Any]]) -> list[str]:
        by_q = {p["Q"]: p for p in points}
        return [
            f"{by_q[q]['bytes_per_s'] / 1e6:.0f} ({by_q[q]['ratio_to_dd']:.2f}×)" if q in by_q
            else "–" for q in qs
        ]  # fmt: skip

    q0 = f.get("q0_per_g", {})
    for G in sorted({p["G"] for p in f["points"]}):
        t.rows.append([str(G), *cells([p for p in f["points"] if p["G"] == G]), str(q0.get(str(G), "–"))])  # fmt: skip
    for G in sorted({p["G"] for p in f.get("merged_points", [])}):
        pts = [p for p in f["merged_points"] if p["G"] == G]
        t.rows.append([f"{G}, merged ≤ {size(pts[0]['merge_bytes'])}", *cells(pts), ""])
    t.notes.append(
        f"Loader MB/s (ratio to `dd iflag=direct`, {f['dd_bytes_per_s'] / 1e6:.0f} MB/s at "
        f"bs={f['dd_best_bs']}) on a cold {f['file_bytes'] / 1e9:.3g} GB file, B = Q + 2, "
        f"medians of {f['repeat']} passes. Q0: the smallest Q within 5 % of the best, per G."
    )
    return t


def render_layout(f: Figures) -> Table:
    t = Table(["step", "time", "MB/s", "÷ disk write"], [])
    write = f["write_mb_per_s"]
    for label, secs, rate in (
        ("write the same bytes (O_DIRECT + fsync; the disk)", "write_seconds", "write_mb_per_s"),
        ("copy the source file", "copy_seconds", "copy_mb_per_s"),
        ("convert only (nothing written)", "convert_seconds", "convert_mb_per_s"),
        ("**pack, end to end**", "pack_seconds", "pack_expert_mb_per_s"),
        ("verify checksums", "verify_seconds", "verify_mb_per_s"),
    ):
        secs_v = f.get(secs)
        t.rows.append([label, f"{secs_v:.1f} s" if secs_v is not None else "–",
                       num(f[rate]), f"{f[rate] / write:.2f}"])  # fmt: skip
    t.notes.append(
        f"{f['arch']} {f['preset']}: {size(f['source_bytes'])} source, "
        f"{size(f['expert_bytes'])} of experts. Peak RSS while packing "
        f"{f['pack_peak_rss_mib']:.0f} MiB; targets (≥ 300 MB/s of expert bytes, < 1 GiB) "
        f"{'met' if f['met'] else 'not met'}."
    )
    return t


def render_sched(f: Figures) -> Table:
    t = Table(["selection for a new budget", "wall median", "wall p99", "CPU median", "CPU p99",
               "budgets"], [])  # fmt: skip
    for label, key in (
        ("`configure`, warm profile", "selection_warm"),
        ("`configure`, freshly loaded profile", "selection_cold"),
        ("baseline: one (g, b) at a time", "baseline_one_candidate_at_a_time"),
    ):
        s = f[key]
        ms = [f"{num(s.get(k))} ms" if s.get(k) is not None else "–"
              for k in ("median_ms", "p99_ms", "cpu_median_ms", "cpu_p99_ms")]  # fmt: skip
        t.rows.append([label, *ms, str(s.get("n") or "–")])
    p = f.get("profile", {})
    if p:
        t.notes.append(
            f"Profile: {p.get('n_experts')} experts, {p.get('calibration_layers')} calibration "
            f"layers, g in {p.get('groups')}, Q0 = {p.get('Q0')}."
        )
    if f.get("speedup_vs_baseline"):
        t.notes.append(f"Speed-up over the baseline (CPU time): {f['speedup_vs_baseline']:.1f}×.")
    return t


def render_tokenizer(f: Figures) -> Table:
    t = Table(["vocabulary", "text", "tokens", "EStream cold tok/s", "EStream warm tok/s",
               "HF tok/s", "llama.cpp tok/s", "cold ÷ HF", "cold ÷ llama.cpp", "same tokens"], [])  # fmt: skip

    def agree(v: Any) -> str:
        return "–" if v is None else "yes" if v else "NO"

    for r in f["rows"]:
        t.rows.append([
            r["vocab"], r["corpus"], str(r["tokens"]), num(r["estream_cold_tok_s"]),
            num(r["estream_warm_tok_s"]), num(r.get("hf_tok_s")), num(r.get("llama_cpp_tok_s")),
            num(r.get("estream_cold_vs_hf")), num(r.get("estream_cold_vs_llama_cpp")),
            f"HF {agree(r.get('hf_agrees'))}, llama.cpp {agree(r.get('llama_cpp_agrees'))}",
        ])  # fmt: skip
    t.notes.append(f"{f['text_kib']} KiB texts, best of {f['repeat']} runs.")
    return t


def _vs(c: dict[str, Any] | None) -> str:
    """A comparison: relative L2 error, top-1 agreement in brackets when known."""
    if not c:
        return "–"
    return f"{c['rel_l2']:.1e}" + (f" ({c['top1']:.3f})" if c.get("top1") is not None else "")


def _vs_llama(c: dict[str, Any] | None, d: dict[str, Any] | None) -> str:
    """`_vs`, then (over several prompts) the engine minus llama.cpp: top-1 difference and error
    ratio, each with its 95% bootstrap interval over prompts."""
    if not c or not d:
        return _vs(c)
    (t_lo, t_hi), (r_lo, r_hi) = d["top1_diff_ci95"], d["rel_l2_ratio_ci95"]
    return (
        f"{_vs(c)}; vs llama.cpp: top-1 {d['top1_diff']:+.3f} [{t_lo:+.3f}, {t_hi:+.3f}], "
        f"error ×{d['rel_l2_ratio']:.2f} [{r_lo:.2f}, {r_hi:.2f}]"
    )


#: a bf16 attention mode may be the q8 default where its error stays within this factor of fp32's
BF16_ATTENTION_LIMIT = 1.05
#: the bf16 attention modes a parity run may hold, and how their column and verdict name them
BF16_MODES = {"bf16": "bf16 attention", "bf16-pv": "bf16 P·V attention"}


def _bf16_ratio(q8: dict[str, Any], bf16: dict[str, Any]) -> float | None:
    """The engine q8 row's error with a bf16 attention mode over its error with fp32
    attention."""
    a, b = q8.get("engine_vs_ref"), bf16.get("engine_vs_ref")
    return b["rel_l2"] / a["rel_l2"] if a and b and a["rel_l2"] > 0 else None


def _log_ratios(q8: dict[str, Any], bf16: dict[str, Any]) -> list[float] | None:
    """Per prompt, log(error with the bf16 mode) - log(error with fp32 attention): the two
    runs saw the same prompts; None without per-prompt errors for both (or a zero error)."""
    a = (q8.get("engine_vs_ref") or {}).get("rel_l2_prompts")
    b = (bf16.get("engine_vs_ref") or {}).get("rel_l2_prompts")
    if not a or not b or len(a) != len(b) or min(a) <= 0 or min(b) <= 0:
        return None
    return [math.log(y) - math.log(x) for x, y in zip(a, b, strict=True)]


def _ratio_ci(logs: list[float], draws: int = 4000) -> tuple[float, float, float]:
    """exp of the mean log ratio (the ratio of geometric-mean errors) and its 95 % percentile
    bootstrap interval over the prompts (resampled with replacement; seeded, so a report is
    rendered the same every time)."""
    rng, n = random.Random(0), len(logs)
    means = sorted(sum(rng.choices(logs, k=n)) / n for _ in range(draws))
    lo, hi = means[int(0.025 * draws)], means[int(0.975 * draws) - 1]
    return math.exp(sum(logs) / n), math.exp(lo), math.exp(hi)


def render_parity(f: Figures) -> Table:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in f["rows"]:  # one row per engine run (activation format, attention precision)
        groups.setdefault((r["arch"], r["variant"]), []).append(r)
    # runs before --engine-attention have no bf16 rows (and no engine_attention: fp32); a
    # column and a verdict per bf16 mode the run holds
    modes = [m for m in BF16_MODES if any(r.get("engine_attention") == m for r in f["rows"])]
    t = Table(["arch", "weights", "llama.cpp vs ref", "engine q8 vs ref",
               *[f"engine q8, {BF16_MODES[m]} vs ref" for m in modes], "engine f32 vs ref",
               "engine f32 vs packed ref",
               "vs the F32 original: ref / engine q8 / llama.cpp", "note"], [])  # fmt: skip
    ratios: dict[str, list[tuple[str, float | None]]] = {m: [] for m in modes}
    # per mode: (row name, per-prompt log ratios, that row's interval) for the pooled verdict
    paired: dict[str, list[tuple[str, list[float], tuple[float, float]]]] = {m: [] for m in modes}
    for (arch, variant), rows in groups.items():
        act = {(r.get("engine_act"), r.get("engine_attention", "f32")): r for r in rows}
        q8, f32, first = act.get(("q8", "f32"), {}), act.get(("f32", "f32"), {}), rows[0]
        src = [first.get("ref_vs_src"), q8.get("engine_vs_src"), first.get("llamacpp_vs_src")]
        note = next((r[k] for r in rows for k in ("error", "llamacpp_error", "engine_note")
                     if r.get(k)), "")  # fmt: skip
        bf16_cells: list[str] = []
        for m in modes:
            bf16 = act.get(("q8", m), {})
            ratio, logs = _bf16_ratio(q8, bf16), _log_ratios(q8, bf16)
            if q8.get("engine_vs_ref") or bf16.get("engine_vs_ref"):
                ratios[m].append((f"{arch} `{variant}`", ratio))
            of_f32 = f"; ×{ratio:.3f} of fp32 attention's" if ratio is not None else ""
            if logs is not None and len(logs) > 1:
                _, lo, hi = _ratio_ci(logs)
                paired[m].append((f"{arch} `{variant}`", logs, (lo, hi)))
                of_f32 = f"; ×{ratio:.3f} [{lo:.3f}, {hi:.3f}] of fp32 attention's"
            bf16_cells.append(_vs(bf16.get("engine_vs_ref")) + of_f32)
        t.rows.append([
            arch, f"`{variant}`", _vs(first.get("llamacpp_vs_ref")),
            _vs_llama(q8.get("engine_vs_ref"), q8.get("engine_minus_llamacpp")), *bf16_cells,
            _vs(f32.get("engine_vs_ref")), _vs(f32.get("engine_vs_packed_ref")),
            " / ".join(f"{c['rel_l2']:.1e}" if c else "–" for c in src) if any(src) else "–",
            note.splitlines()[0] if note else "",
        ])  # fmt: skip
    n = f.get("prompts") or 1
    t.notes.append(
        f"All-position logits, {f['tokens']} random tokens"
        + (f" × {n} prompts (the same for both engines)" if n > 1 else "")
        + ": relative L2 error against the float64 reference of the same GGUF"
        + (" (geometric mean over prompts)" if n > 1 else "")
        + ", top-1 agreement in brackets; `packed ref` is the reference of the file as the "
        "packer stores it."
        + (
            " `vs llama.cpp`: the engine's top-1 agreement minus llama.cpp's and the ratio of "
            "their errors, with 95% bootstrap intervals over prompts."
            if n > 1
            else ""
        )
        + (f" llama-cpp-python {f['llama_cpp_python']}." if f.get("llama_cpp_python") else "")
    )
    for m in modes:
        t.notes.append(_bf16_verdict(ratios[m], BF16_MODES[m]) + _bf16_paired(paired[m]))
    return t


def _bf16_paired(rows: list[tuple[str, list[float], tuple[float, float]]]) -> str:
    """What the prompts resolve (rows with per-prompt errors, each with its own interval): the
    ratio over every prompt of every such row, paired, with its 95 % bootstrap interval, and
    the rows whose interval lies wholly above `BF16_ATTENTION_LIMIT` (a row's ratio over few prompts moves by several
    per cent with the routing decisions that rounding flips, so its point value alone does not
    tell the modes apart)."""
    if not rows:
        return ""
    logs = [x for _, row, _ in rows for x in row]
    ratio, lo, hi = _ratio_ci(logs)
    above = [f"{name} [{r_lo:.3f}, {r_hi:.3f}]" for name, _, (r_lo, r_hi) in rows
             if r_lo > BF16_ATTENTION_LIMIT]  # fmt: skip
    return (
        f" Paired over the {len(logs)} prompts of {len(rows)} row{'s' if len(rows) > 1 else ''}: "
        f"×{ratio:.3f} [{lo:.3f}, {hi:.3f}] of the fp32-attention error (95 % bootstrap interval "
        f"over prompts); rows whose interval lies above {round((BF16_ATTENTION_LIMIT - 1) * 100)} %: "
        + (", ".join(above) if above else "none")
        + "."
    )


def _bf16_verdict(ratios: list[tuple[str, float | None]], name: str = "bf16 attention") -> str:
    """One line: whether every row's engine q8 error with bf16 attention mode ``name`` is within
    `BF16_ATTENTION_LIMIT` of its error with fp32 attention, else the rows over it."""
    lim = f"{round((BF16_ATTENTION_LIMIT - 1) * 100)} %"
    head = f"{name} (engine q8; `engine q8 vs ref` is with fp32 attention): "
    missing = [name for name, r in ratios if r is None]
    over = [f"{name} ×{r:.3f}" for name, r in ratios if r is not None and r > BF16_ATTENTION_LIMIT]
    known = [r for _, r in ratios if r is not None]
    if not known:
        return head + "no row ran both."
    if over:
        verdict = f"rows over {lim}: " + ", ".join(over) + "."
    else:
        verdict = (
            f"every row within {lim} of the fp32-attention error "
            f"(ratios {min(known):.3f}–{max(known):.3f})."
        )
    if missing:
        verdict += " Without both runs: " + ", ".join(missing) + "."
    return head + verdict


def render_eval_parity(f: Figures) -> Table:
    t = Table(["arch", "context", "windows", "EStream perplexity", "llama.cpp perplexity",
               "ratio", "paired ΔNLL per token", "top-1 agreement"], [])  # fmt: skip

    def ppl(side: dict[str, Any]) -> str:
        se = side.get("perplexity_stderr")
        return f"{side['perplexity']:.6g}" + (f" ± {se:.5g}" if se is not None else "")

    for r in f["rows"]:
        d, se = r.get("nll_diff_mean"), r.get("nll_diff_stderr")
        t.rows.append([
            r["arch"], str(r["ctx"]), str(r["windows"]), ppl(r["estream"]), ppl(r["llama_cpp"]),
            f"{r['ppl_ratio']:.4f}", f"{d:+.5f} ± {se:.5f}" if d is not None else "–",
            f"{r['top1_agreement']:.3f}",
        ])  # fmt: skip
    t.notes.append(f"`estream eval perplexity` on {f['text']} ({f['chars']} characters).")
    return t


def render_hexagon(f: Figures) -> Table:
    kinds = ("host", "host-process", "hexagon")
    t = Table(["", "host", "host-process", "hexagon (executor under qemu)"], [])

    def rt(key: str) -> str:
        s = f.get(key)
        if not s:
            return "–"
        spread = f" ({num(s['p10_us'])}–{num(s['p90_us'])})" if s.get("p10_us") is not None else ""
        return f"{num(s['median_us'])} µs{spread}"

    t.rows.append(["C call `htp_op_run`", *[rt(f"c_{k}") for k in kinds]])
    t.rows.append(["Python `htp.nop`", *[rt(f"py_{k}") for k in kinds]])
    start = f.get("start_s", {})
    t.rows.append(["backend start (to the first op done)",
                   *[f"{num(start[k] * 1e3)} ms" if k in start else "–" for k in kinds]])  # fmt: skip
    t.notes.append("Empty-op round trips: median (p10–p90), one thread each side.")
    return t


def render_packets(f: Figures) -> Table:
    t = Table(
        ["strip kernel", "setup per 32×32 tile", "per token", "tile at 1 / 8 / 64 tokens"], []
    )
    for name, c in f.items():
        if not isinstance(c, dict) or "per_tile" not in c:
            continue
        per = " / ".join(num(c["per_tile"].get(n)) for n in ("1", "8", "64"))
        t.rows.append([name, f"{c['per_tile_setup']:.0f}", f"{c['per_tile_per_token']:.0f}", per])
    t.notes.append("Hexagon packets executed (QEMU's execution log), one 32-row strip.")
    return t


NEON_KINDS = ("sdot", "mmla", "load", "store", "fp", "convert", "int_vector")


def render_neon_mix(f: Figures) -> Table:
    t = Table(["strip kernel", "table, tiles, QEMU CPU", "tile at 1 / 2 / 4 / 8 tokens",
               "per token", "SDOT / MMLA / load / store / fp / convert / other vector / scalar, "
               "per token"],
              [])  # fmt: skip
    for c in f.values():
        if not isinstance(c, dict) or "per_tile" not in c:
            continue
        per = c["per_tile_per_token"]
        mix = [num(per.get(k)) for k in NEON_KINDS]
        mix.append(num(per["scalar"] + per["branch"]) if "scalar" in per else "–")
        tiles = " / ".join(num(c["per_tile"].get(n, {}).get("total")) for n in ("1", "2", "4", "8"))
        t.rows.append([
            f"`{c['function']}`", f"{c['table']}, {c['format']}, {c.get('cpu', 'max')}", tiles,
            num(per["total"]), " / ".join(mix),
        ])  # fmt: skip
    t.notes.append(
        "arm64 instructions executed per 32×32 tile (QEMU's execution log), one 32-row strip, Q8 "
        "activations; a tile and token is 1024 MACs: 64 SDOT or 32 SMMLA. The neon table is "
        "traced on QEMU's cortex-a76 (dot product, no FEAT_I8MM), neon_i8mm on its max CPU "
        "(FEAT_I8MM: the library takes that table there). Per token: the steady state, the "
        "8-token tile less the 4-token one, over 4 (older runs: the 2-token tile less the "
        "1-token one)."
    )
    att = Table(["attention task", "table, products", "diagonal block", "per key block",
                 "BF16 / load / store / fp / convert / other vector / scalar, per key block"],
                [])  # fmt: skip
    for c in f.values():
        if not isinstance(c, dict) or "per_key_block" not in c:
            continue
        b = c["per_key_block"]
        mix = [f"{b.get(k, 0):.0f}" for k in ATTN_KINDS] + [f"{b['scalar'] + b['branch']:.0f}"]
        att.rows.append([
            f"`{c['function']}`", f"{c['table']}, {c['products']}",
            f"{c['measured']['nkb=1']['total']:.0f}", f"{b['total']:.0f}", " / ".join(mix),
        ])  # fmt: skip
    if att.rows:
        dk = next(c["dk"] for c in f.values() if isinstance(c, dict) and "per_key_block" in c)
        t.more.append((
            f"arm64 instructions executed by one (head, query block) attention task, 64 causal "
            f"queries, dk = dv = {dk}, one thread: its diagonal key block alone, and one more "
            f"fully visible block of 64 keys (64 × 64 × {2 * dk} MACs); BF16 counts "
            "BFMLALB / BFMLALT (4 MACs each, as a 4-lane FMLA).",
            att,
        ))  # fmt: skip
    return t


ATTN_KINDS = ("bf16", "load", "store", "fp", "convert", "int_vector")


@dataclass(frozen=True)
class Bench:
    title: str
    render: Callable[[Figures], Table]
    #: False for figures that are not times (errors, packet counts): a loaded machine is
    #: noted, but does not make them "not a result".
    timed: bool = True
    #: What distinguishes runs that do not replace each other (another model or quantization):
    #: the page shows the newest result of each variant. None: one result, the newest.
    variant: Callable[[Figures], str] | None = None


def _parity_rows(f: Figures) -> set[tuple[str, str]]:
    return {(str(r.get("arch")), str(r.get("variant"))) for r in f.get("rows", [])}


def _superseded(name: str, doc: dict[str, Any], others: list[dict[str, Any]]) -> bool:
    """A parity result all of whose rows a newer result also has: that one replaces it."""
    if name != "parity":
        return False
    mine = _parity_rows(doc["figures"])
    key = (doc["date"] or "",)
    return any(mine <= _parity_rows(o["figures"]) and (o["date"] or "",) > key for o in others)


def parity_variant(f: Figures) -> str:
    """A parity run's architectures and weight variants (a run of a few rows does not replace
    the whole table)."""
    archs = sorted({str(r.get("arch")) for r in f.get("rows", [])})
    variants = sorted({str(r.get("variant")) for r in f.get("rows", [])})
    return f"{', '.join(archs)}; {', '.join(variants)}"


def kernels_variant(f: Figures) -> str:
    """`bench_kernels -- --attention` (attention rows only) beside the whole kernel table."""
    ops = [str(r.get("op", "")) for r in f.get("rows", [])]
    return "attention" if ops and all(o.startswith("attention") for o in ops) else "all kernels"


#: The cached model's name: ARCH-PRESET-sSEED[-QUANT] (bench_engine.model_paths); an arch name
#: may hold a dash (gpt-oss), a preset may hold "-s" (smallthinker-4b-...).
_ENGINE_MODEL = re.compile(r"(gpt-oss|[^-]+)-(.+)-s\d+(?:-[a-z0-9_]+)?")
#: Families whose preset's own expert type (what `--quant q4_0`, "the preset's types", gives)
#: is not Q4_0.
_PRESET_EXPERTS = {"gpt-oss": "mxfp4 experts"}
#: The family each published-model preset imitates by default (estream-synth's PRESET_ARCH):
#: a file of such a preset in another family's layout is named so (OLMoE's shapes as
#: ``qwen3moe``, for runtimes without an ``olmoe`` architecture).
_PRESET_FAMILY = {
    "olmoe-1b-7b": "olmoe", "qwen3-30b-a3b": "qwen3moe", "mixtral-8x7b": "mixtral",
    "deepseek-v2-lite": "deepseek2", "lfm2-8b-a1b": "lfm2moe",
    "smallthinker-4b-a0.6b": "smallthinker", "smallthinker-21b-a3b": "smallthinker",
    "gpt-oss-20b": "gpt-oss",
}  # fmt: skip


def _lengths_label(lengths: list[int]) -> str:
    return ", ".join(f"{T // 1024}K" if T % 1024 == 0 else str(T) for T in lengths)


def engine_model(f: Figures) -> str:
    """bench_engine's model (the preset of the cached file's name) and quantization."""
    stem = Path(str(f.get("model") or "")).name.removesuffix(".estream")
    quant = str(f.get("quant") or "q4_0")
    m = _ENGINE_MODEL.fullmatch(stem)
    if m is None:
        return f"olmoe-1b-7b, {quant}"
    if quant == "q4_0":
        quant = _PRESET_EXPERTS.get(m.group(1), quant)
    layout = m.group(1) != _PRESET_FAMILY.get(m.group(2), m.group(1))
    return f"{m.group(2)}" + (f" as {m.group(1)}" if layout else "") + f", {quant}"


def engine_variant(f: Figures) -> str:
    """bench_engine's model and quantization (`engine_model`) and its prompt lengths, free and
    memory-capped: a run of other lengths does not replace a model's result (a 4K run leaves
    the 256/1K and cgroup figures of the same model on the page)."""
    free, capped = _engine_lengths(f, False), _engine_lengths(f, True)
    lengths = _lengths_label(free) if free else "no free run"
    # a run with other attention products (bench_engine --attention) sits beside the fp32 one
    att = sorted({str(r["attention"]) for r in f["runs"] if r.get("attention", "f32") != "f32"})
    # a run with pinned experts (bench_engine --pin) sits beside the one without
    pinned = any(r.get("pinned_bytes") for r in f["runs"])
    # a run that also measured the reads' cost (bench_engine --io-tax, usually without --trace
    # or ik_llama.cpp) sits beside the one without
    io_tax = any(r.get("system") == IO_TAX for r in f["runs"])
    # a run that also measured the read margin under a read cap (bench_engine --read-cap)
    read_capped = any(r.get("system") in READ_CAP for r in f["runs"])
    # a run with extra stream / resident pairs (bench_engine --pairs)
    pairs = len({r.get("pair") for r in f["runs"] if r.get("system") in PAIRED})
    return (
        f"{engine_model(f)}; {lengths}"
        + (f"; capped {_lengths_label(capped)}" if capped else "")
        + (f"; attention {', '.join(att)}" if att else "")
        + ("; pinned experts" if pinned else "")
        + ("; the reads' cost" if io_tax else "")
        + ("; reads capped" if read_capped else "")
        + (f"; {pairs + 1} pairs" if pairs else "")
    )


#: How each benchmark is shown (same names as `record.BENCHES`, in page order).
BENCHES: dict[str, Bench] = {
    "bench_engine": Bench(
        "End-to-end prefill: stream vs resident vs llama.cpp",
        render_engine,
        variant=engine_variant,
    ),
    "bench_tasks": Bench("Many short requests: batched vs one by one", render_tasks),
    "bench_ray": Bench("Corpus classify on Ray Data: 1 and 2 actors", render_ray),
    "bench_vs_llama": Bench("Prefill tokens/s against llama-bench on one GGUF", render_vs_llama),
    "bench_scale": Bench("Models larger than memory", render_scale),
    "bench_kernels": Bench(
        "Kernels against numpy/BLAS float32", render_kernels, variant=kernels_variant
    ),
    "bench_arena": Bench("Loader bandwidth over G × Q against dd", render_arena),
    "bench_layout": Bench("Packing throughput and peak memory", render_layout),
    "bench_sched": Bench("Configurator selection time", render_sched),
    "bench_tokenizer": Bench("Tokenization speed", render_tokenizer),
    "parity": Bench(
        "Logits against a float64 reference, engine and llama.cpp",
        render_parity,
        timed=False,
        variant=parity_variant,
    ),
    "eval_parity": Bench("Perplexity against llama.cpp", render_eval_parity, timed=False),
    "bench_hexagon": Bench("Host side of the hexagon protocol", render_hexagon),
    "hexagon_packets": Bench("Hexagon tile kernel, packets", render_packets, timed=False),
    "neon_instr_mix": Bench(
        "arm64 tile kernels, instructions by kind", render_neon_mix, timed=False
    ),
}


# -- results ------------------------------------------------------------------------------------


def load_results(results: Path = record.RESULTS) -> dict[str, list[tuple[Path, dict[str, Any]]]]:
    """Every result file under `results/<bench>/`, validated, per benchmark."""
    out: dict[str, list[tuple[Path, dict[str, Any]]]] = {}
    for path in sorted(results.glob("*/*.json")):
        where = str(path.relative_to(results.parent))
        try:
            doc = json.loads(path.read_text())
        except ValueError as exc:
            raise ReportError(f"{where}: not JSON ({exc})") from None
        try:
            record.validate(doc, where)
        except record.ResultError as exc:
            raise ReportError(str(exc)) from None
        if doc["bench"] != path.parent.name:
            raise ReportError(f"{where}: a {doc['bench']} result in the {path.parent.name} folder")
        out.setdefault(doc["bench"], []).append((path, doc))
    return out


def latest(entries: list[tuple[Path, dict[str, Any]]]) -> tuple[Path, dict[str, Any]]:
    """The newest result: by date (a recorded run's full time sorts after a bare date), then by
    file name."""
    return max(entries, key=lambda e: (e[1]["date"] or "", e[0].name))


def load_state(doc: dict[str, Any]) -> tuple[float | None, int | None]:
    """The highest 1-minute load average known for the run (recorded, or stated by the text a
    transcribed result came from) and the core count."""
    if doc["load_average_1min"] is not None:
        loads = [v for v in doc["load_average_1min"].values() if v is not None]
    else:
        loads = list(doc.get("stated_load_average") or [])
    return (max(loads) if loads else None), doc["machine"].get("cores")


def is_loaded(doc: dict[str, Any]) -> bool:
    """Whether the run shared its CPUs: a load average above `LOADED_PER_CORE` per core before
    it, or above that plus one per core after it (the 1-minute average just after a run that
    kept every core busy is about one per core by itself). A transcribed result is judged by
    the highest load its text states."""
    load, cores = load_state(doc)
    if load is None or not cores:
        return False
    la = doc["load_average_1min"]
    if la is None:
        return load / cores > LOADED_PER_CORE
    before, after = la.get("before"), la.get("after")
    return (before is not None and before / cores > LOADED_PER_CORE) or (
        after is not None and after / cores > LOADED_PER_CORE + 1
    )


def _machine(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    if m.get("description"):
        return m["description"]
    simd = " ".join(m["simd_flags"]) or "none listed"
    return f"{m['cpu_model'] or 'unknown CPU'}, {m['cores']} cores ({m['arch']}; SIMD: {simd})"


def _date(doc: dict[str, Any]) -> str:
    d = doc["date"]
    if d is None:
        return "not stated"
    return d.replace("T", " ").replace("Z", " UTC") if "T" in d else d


def _commit(doc: dict[str, Any]) -> str:
    if doc["transcribed"]:
        src = doc["source"]
        return f"not recorded (figures transcribed from {src['file']} at `{src['commit'][:10]}`)"
    if doc["commit"] is None:
        return "not recorded (not a git checkout)"
    return f"`{doc['commit'][:10]}`" + (" with uncommitted changes" if doc["dirty"] else "")


def _load(doc: dict[str, Any]) -> str:
    cores = doc["machine"].get("cores")
    on = f" on {cores} cores" if cores else ""
    la = doc["load_average_1min"]
    if la is None:
        stated = doc.get("stated_load_average")
        if stated:
            lo, hi = min(stated), max(stated)
            text = f"{lo:g}" if lo == hi else f"{lo:g}–{hi:g}"
            return f"not recorded by the run; the text states {text}{on}"
        return "not recorded"
    b, a = (num(la[k]) if la[k] is not None else "unknown" for k in ("before", "after"))
    return f"{b} before, {a} after{on}"


def status(doc: dict[str, Any]) -> str:
    """The verdict shown above a result's table."""
    marks = []
    if is_loaded(doc):
        load, cores = load_state(doc)
        why = f"load average {load:g} on {cores} cores, above {LOADED_PER_CORE} per core"
        if doc["load_average_1min"] is not None:
            why += f" before the run or {LOADED_PER_CORE + 1} after it"
        if BENCHES[doc["bench"]].timed:
            marks.append(f"**loaded machine: not a result** ({why})")
        else:
            marks.append(f"loaded machine ({why}); these figures are not timings")
    if doc["transcribed"]:
        stated = " by the run (stated in the text)" if doc.get("stated_load_average") else ""
        marks.append(f"transcribed; load average not recorded{stated}")
    elif doc["load_average_1min"] is None or None in doc["load_average_1min"].values():
        marks.append("load average not recorded")
    return "; ".join(marks) or "ok"


OK = (
    f"> measured; load average within {LOADED_PER_CORE} per core before the run "
    f"and {LOADED_PER_CORE + 1} after it"
)


def section(name: str, path: Path, doc: dict[str, Any], label: str = "") -> list[str]:
    bench = BENCHES[name]
    try:
        table = bench.render(doc["figures"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise ReportError(
            f"{path.name} ({name}): figures not as its renderer expects: {exc!r}"
        ) from None
    steal = doc["steal_s"]
    lines = [
        f"## {name}: {bench.title}" + (f" ({label})" if label else ""),
        "",
        f"> {status(doc)}" if status(doc) != "ok" else OK,
        "",
        "| | |",
        "|---|---|",
        f"| machine | {_machine(doc)} |",
        f"| date | {_date(doc)} |",
        f"| commit | {_commit(doc)} |",
        f"| command | `{doc['command']}` |" if doc["command"] else "| command | not recorded |",
        f"| load average (1 min) | {_load(doc)} |",
        f"| steal during the run | {num(steal) + ' s' if steal is not None else 'not recorded'} |",
        f"| result file | `{RESULTS_SHOWN}/{name}/{path.name}` |",
        "",
        *table.markdown(),
        "",
    ]
    if doc["transcribed"]:
        table.notes.append(doc["note"])
    lines += [*table.notes, ""] if table.notes else []
    for caption, sub in table.more:
        lines += [caption, "", *sub.markdown(), ""]
    return lines


def render_page(results: dict[str, list[tuple[Path, dict[str, Any]]]]) -> str:
    """The whole of docs/benchmarks.md: a function of the result files alone."""
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by `nox -s bench_report` from benchmarks/results/. Do not edit: "
        "regenerate. -->",
        "",
        "Generated by `nox -s bench_report` from the newest result of each benchmark in",
        "`benchmarks/results/`. Every `nox -s bench_*` session (and `parity`, `eval_parity`,",
        "`hexagon`) records its run there as one JSON file: the machine (CPU model and flags,",
        "cores), the 1-minute load average before and after, the hypervisor's steal during the",
        "run, the commit, the date, the exact command and the script's own figures. Older results",
        "stay in that folder; this page shows the newest of each benchmark (of each model and",
        "quantization for bench_engine, attention apart from the other kernels for bench_kernels,",
        "of each set of architectures and variants for parity).",
        "",
        f"A run whose load average exceeded {LOADED_PER_CORE} per core (1.5 on a 2-core machine) "
        f"before it, or {LOADED_PER_CORE + 1} per core after it (the run's own threads add about "
        "one per core),",
        "is marked **loaded machine: not a result**: other work shared its CPUs, so its times",
        "are not the code's (figures that are not timings, such as parity errors or packet",
        "counts, are only noted). *Transcribed* results were copied from earlier documentation;",
        "their load average was not recorded by the run.",
        "",
    ]
    missing = [n for n in BENCHES if n not in results]
    for name in BENCHES:
        if name not in results:
            continue
        variant = BENCHES[name].variant
        if variant is None:
            path, doc = latest(results[name])
            lines += section(name, path, doc)
            continue
        groups: dict[str, list[tuple[Path, dict[str, Any]]]] = {}
        for entry in results[name]:
            groups.setdefault(variant(entry[1]["figures"]), []).append(entry)
        newest = {label: latest(entries) for label, entries in groups.items()}
        for label in sorted(newest):
            path, doc = newest[label]
            if not _superseded(name, doc, [d for lb, (_, d) in newest.items() if lb != label]):
                lines += section(name, path, doc, label)
    if missing:
        lines += ["## Not yet recorded", "", ", ".join(f"`{n}`" for n in missing) + ".", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def _headline_table(f: Figures) -> Table:
    t = Table(["prompt", "stream", "resident", "llama.cpp", "stream ÷ resident",
               "stream ÷ llama.cpp", "peak: stream / resident / llama.cpp"], [])  # fmt: skip
    for T in (1024, 4096):
        s, r, ll = (_engine_run(f, x, T, False) for x in ("stream", "resident", "llama.cpp"))
        if s or r or ll:
            peaks = " / ".join(size((x or {}).get("peak_memory_bytes")) for x in (s, r, ll))
            over_r = ratio(s, r)
            pairs = _pairs(f, T)
            if pairs is not None:  # the medians over the pairs, not one pair's figures
                ratios, runs = pairs
                s, r = _median_run(runs["stream"]), _median_run(runs["resident"])
                over_r = f"{statistics.median(ratios):.3f} (median of {len(ratios)} pairs)"
            t.rows.append([f"{prompt(T)} tokens", ttft(s), ttft(r), ttft(ll), over_r,
                           ratio(s, ll), peaks])  # fmt: skip
    return t


def attention_option(doc: dict[str, Any]) -> str | None:
    """The ``--attention`` a bench_engine result's command line asked for (None: not given, the
    engine's default: "auto" since it became the default, fp32 attention before)."""
    m = re.search(r"--attention(?:=|\s+)(\S+)", doc.get("command") or "")
    return m.group(1) if m else None


def headline(results: dict[str, list[tuple[Path, dict[str, Any]]]]) -> str:
    """The README's headline: bench_engine's 1K and 4K rows from its newest result on the
    OLMoE-1B-7B-shaped Q4_0 model with the engine's defaults (attention as the engine picks it:
    no ``--attention`` or ``--attention auto``; no pinned experts) that has them and was not
    taken on a loaded machine (else the newest that has them, marked)."""
    headline_runs = [
        e
        for e in results.get("bench_engine", [])
        if engine_model(e[1]["figures"]) == "olmoe-1b-7b, q4_0"
        and attention_option(e[1]) in (None, "auto")
        and not any(r.get("pinned_bytes") for r in e[1]["figures"]["runs"])
    ]
    newest_first = sorted(headline_runs, key=lambda e: (e[1]["date"] or "", e[0].name))[::-1]
    usable = [(d, _headline_table(d["figures"])) for _, d in newest_first]
    usable = [(d, t) for d, t in usable if t.rows]
    if not usable:
        raise ReportError("no bench_engine result with a 1K or 4K run in benchmarks/results/")
    doc, t = next(((d, t) for d, t in usable if not is_loaded(d)), usable[0])
    mark = f" ({status(doc)})" if status(doc) != "ok" else ""
    return "\n".join([
        *t.markdown(),
        "",
        f"`nox -s bench_engine` on {_machine(doc)}, {_date(doc)}{mark}.",
    ])  # fmt: skip


def replace_between(text: str, block: str, where: str) -> str:
    """`text` with what lies between the headline markers replaced by `block`."""
    starts, ends = text.count(HEADLINE_START), text.count(HEADLINE_END)
    if starts != 1 or ends != 1 or text.index(HEADLINE_START) > text.index(HEADLINE_END):
        raise ReportError(
            f"{where}: needs exactly one {HEADLINE_START} followed by one {HEADLINE_END} "
            f"(found {starts} and {ends}); put them where the headline table belongs"
        )
    head, rest = text.split(HEADLINE_START)
    _, tail = rest.split(HEADLINE_END)
    return f"{head}{HEADLINE_START}\n{block}\n{HEADLINE_END}{tail}"


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="bench_report", description="Render docs/benchmarks.md and the README headline."
    )
    ap.add_argument("--results", type=Path, default=record.RESULTS, help="results folder")
    ap.add_argument("--page", type=Path, default=PAGE, help="the page to write")
    ap.add_argument("--readme", type=Path, default=README, help="the README with the markers")
    ap.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if either file is out of date"
    )
    args = ap.parse_args(argv)
    try:
        results = load_results(args.results)
        page = render_page(results)
        readme_text = args.readme.read_text() if args.readme.exists() else None
        if readme_text is None:
            raise ReportError(f"{args.readme}: no such file")
        readme = replace_between(readme_text, headline(results), str(args.readme))
    except ReportError as exc:
        print(f"bench_report: error: {exc}", file=sys.stderr)
        return 2
    stale = [
        p for p, text in ((args.page, page), (args.readme, readme))
        if not p.exists() or p.read_text() != text
    ]  # fmt: skip
    if args.check:
        for p in stale:
            print(f"bench_report: {p} is out of date; run `nox -s bench_report`", file=sys.stderr)
        return 1 if stale else 0
    _write(args.page, page)
    _write(args.readme, readme)
    print(f"bench_report: wrote {args.page} ({sum(len(v) for v in results.values())} results)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
