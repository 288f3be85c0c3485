"""Benchmark results and the generated benchmark page (benchmarks/record.py, benchmarks/report.py):
what a recorded run holds, how the page marks runs on a loaded machine, and that the committed
page and README headline are exactly what the committed results render to."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import record, report  # noqa: E402

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse4_2 avx2 fma avx512f avx512_vnni sha_ni
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse4_2 avx2 fma avx512f avx512_vnni sha_ni
"""


def engine_figures(stream: float = 2.0, resident: float = 4.0) -> dict[str, Any]:
    """bench_engine's output shape: one run per system and length, no memory cap."""
    runs = []
    for T in (1024, 4096):
        for system, t in (("stream", stream), ("resident", resident), ("llama.cpp", 8.0)):
            runs.append({"system": system, "length": T, "cgroup": False, "ttft_s": t * T / 1024,
                         "peak_memory_bytes": 600 * 2**20, "steal_s": 0.5})  # fmt: skip
    return {"budget_bytes": 1536 * 2**20, "threads": 2, "runs": runs, "cgroup_note": None}


def recorded(
    tmp_path: Path,
    bench: str,
    figures: dict[str, Any],
    load: tuple[float, float],
    args: str = "--x 1",
) -> dict[str, Any]:
    """A result written through `record.record`, as the nox sessions do, with given loads and
    the session's arguments ``args``."""
    fig_dir = tmp_path / "bench-results"
    fig_dir.mkdir(exist_ok=True)
    before = {**record.sample(), "loadavg_1min": load[0]}
    (fig_dir / record.BENCHES[bench]).write_text(json.dumps(figures))
    after = {**record.sample(), "loadavg_1min": load[1]}
    path = record.record(
        bench, before=before, after=after, command=f"nox -s {bench} -- {args}",
        script_command=["python", "s.py", "--x", "1"], figures_dir=fig_dir,
        results=tmp_path / "results",
    )  # fmt: skip
    return json.loads(path.read_text())


def test_a_recorded_run_holds_every_field(tmp_path: Path) -> None:
    """record() writes valid JSON with every schema field: this machine's CPU, cores, load
    before/after, steal, the checked-out commit, a UTC date, the command and the figures as
    the script wrote them; the file is named by time and commit and no temp file is left."""
    figures = engine_figures()
    doc = recorded(tmp_path, "bench_engine", figures, (0.25, 0.5))
    assert list(doc) == list(record.KEYS)
    assert doc["schema"] == 1 and doc["bench"] == "bench_engine" and doc["transcribed"] is False
    assert doc["figures"] == figures
    assert doc["load_average_1min"] == {"before": 0.25, "after": 0.5}
    assert doc["command"] == "nox -s bench_engine -- --x 1"
    assert doc["script_command"] == ["python", "s.py", "--x", "1"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert doc["commit"] == head.stdout.strip() and isinstance(doc["dirty"], bool)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", doc["date"])
    assert doc["machine"]["cores"] == os.cpu_count()
    assert set(doc["machine"]["simd_flags"]) <= set(doc["machine"]["cpu_flags"])
    if Path("/proc/stat").exists():
        assert doc["steal_s"] is not None and doc["steal_s"] >= 0
    assert doc["wall_s"] >= 0
    files = list((tmp_path / "results" / "bench_engine").iterdir())
    stamp = doc["date"].replace("-", "").replace(":", "")
    assert [f.name for f in files] == [f"{stamp}-{doc['commit'][:10]}.json"]


def test_cpuinfo_and_steal_are_parsed() -> None:
    """The CPU model, all flags and their SIMD subset come from /proc/cpuinfo's first CPU; the
    steal is the eighth number of /proc/stat's cpu line, in seconds."""
    info = record.parse_cpuinfo(CPUINFO)
    assert info["cpu_model"] == "AMD EPYC 7B13"
    assert info["cpu_flags"] == sorted(["fpu", "sse4_2", "avx2", "fma", "avx512f",
                                        "avx512_vnni", "sha_ni"])  # fmt: skip
    assert info["simd_flags"] == ["sse4_2", "avx2", "fma", "avx512f", "avx512_vnni"]
    stat = "cpu  10 0 20 300 4 0 1 250 0 0\ncpu0 5 0 10 150 2 0 1 125 0 0\n"
    assert record.parse_steal_s(stat, 100) == 2.5
    assert record.parse_steal_s("cpu  1 2 3 4\n", 100) is None


def test_stale_or_missing_figures_are_refused(tmp_path: Path) -> None:
    """A figures file older than the run (the script wrote nothing this time) or absent is not
    recorded: ResultError naming the file, and no result written."""
    fig = tmp_path / record.BENCHES["bench_sched"]
    before = record.sample()
    kwargs = {"before": before, "after": before, "command": "c", "script_command": [],
              "figures_dir": tmp_path, "results": tmp_path / "results"}  # fmt: skip
    with pytest.raises(record.ResultError, match="wrote no figures file"):
        record.record("bench_sched", **kwargs)
    fig.write_text("{}")
    os.utime(fig, (time.time() - 60, time.time() - 60))
    with pytest.raises(record.ResultError, match="not rewritten by this run"):
        record.record("bench_sched", **kwargs)
    assert not (tmp_path / "results").exists()


def test_validate_names_the_missing_field(tmp_path: Path) -> None:
    """A result without one of the schema's fields is rejected, naming the field, and the
    report refuses a results folder holding it."""
    doc = recorded(tmp_path, "bench_engine", engine_figures(), (0.1, 0.1))
    del doc["steal_s"]
    with pytest.raises(record.ResultError, match="missing steal_s"):
        record.validate(doc)
    bad = tmp_path / "results" / "bench_engine" / "20990101T000000Z-x.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(report.ReportError, match="missing steal_s"):
        report.load_results(tmp_path / "results")


@pytest.mark.parametrize(
    ("load", "loaded"),
    [((0.2, 3.6), True), ((1.6, 0.2), True), ((1.5, 3.5), False), ((0.2, 2.1), False)],
)
def test_a_loaded_run_is_marked_not_a_result(
    tmp_path: Path, load: tuple[float, float], loaded: bool
) -> None:
    """On 2 cores a run whose load average exceeded 1.5 before it (0.75 per core), or 3.5 after
    it (its own two threads account for about 2), is marked 'loaded machine: not a result' on
    the page and in the headline; at exactly those values, or 2.1 after it, it is not."""
    recorded(tmp_path, "bench_engine", engine_figures(), load)
    results = report.load_results(tmp_path / "results")
    _, doc = report.latest(results["bench_engine"])
    doc["machine"]["cores"] = 2
    page, head = report.render_page(results), report.headline(results)
    mark = "**loaded machine: not a result**"
    assert (f"> {mark}" in page) is loaded and (mark in head) is loaded
    assert ("measured; load average within 0.75 per core" in page) is not loaded


def test_a_loaded_run_of_figures_that_are_not_timings_is_only_noted(tmp_path: Path) -> None:
    """Parity errors do not depend on the load: a parity run on a loaded machine is noted as
    such but not marked 'not a result'."""
    figures, _ = FIGURES["parity"]
    recorded(tmp_path, "parity", figures, (0.1, 8.0))
    results = report.load_results(tmp_path / "results")
    doc = report.latest(results["parity"])[1]
    doc["machine"]["cores"] = 2
    assert report.status(doc).startswith("loaded machine (load average 8 on 2 cores")
    assert "not a result" not in report.status(doc)


def test_engine_table_and_headline_figures(tmp_path: Path) -> None:
    """The bench_engine table and the README headline show each system's time to first token
    and the ratios computed from them, at 1K and 4K."""
    recorded(tmp_path, "bench_engine", engine_figures(stream=3.0, resident=4.0), (0.1, 0.1))
    head = report.headline(report.load_results(tmp_path / "results"))
    assert "| 1K tokens | 3 s | 4 s | 8 s | 0.750 | 0.375 |" in head
    assert "| 4K tokens | 12 s | 16 s | 32 s | 0.750 | 0.375 |" in head


def test_engine_runs_with_a_per_op_table_render_it(tmp_path: Path) -> None:
    """A bench_engine result whose stream run carries a per-op table (``--trace``) shows it
    under the engine table, a row per op kind with its time, share, work, rate and share of
    the recorded peak; a run without one adds no table."""
    figures = engine_figures(stream=3.0)
    stream_1k = next(r for r in figures["runs"] if r["system"] == "stream" and r["length"] == 1024)
    stream_1k["op_table"] = {
        "total_s": 3.0,
        "rows": [
            {"op": "experts", "time_s": 2.0, "share": 2 / 3, "precision": "int8", "gop": 50.0,
             "gops": 25.0, "pct_of_peak": 12.5},
            {"op": "expert_wait", "time_s": 0.5, "share": 0.5 / 3, "precision": None,
             "gop": None, "gops": None, "pct_of_peak": None},
            {"op": "untimed", "time_s": 0.5, "share": 0.5 / 3, "precision": None, "gop": None,
             "gops": None, "pct_of_peak": None},
        ],
        "per_layer_s": {},
    }  # fmt: skip
    figures["peaks_gops"] = {"int8": 200.0, "fp32": 80.0, "bf16": None}
    recorded(tmp_path, "bench_engine", figures, (0.1, 0.1))
    page = report.render_page(report.load_results(tmp_path / "results"))
    assert page.count("**Per-op table:") == 1
    assert "**Per-op table: `stream`, 1K tokens** (TTFT 3 s)" in page
    assert "| `experts` | 2000 ms | 66.7 % | 50 | 25 | int8 | 12.5 % |" in page
    assert "| `expert_wait` | 500 ms | 16.7 % | – | – | – | – |" in page
    assert "int8 200, fp32 80)" in page
    assert "int8_step" not in page  # not measured in this run
    assert "shares of peak are not results" not in page
    stepped = tmp_path / "stepped"
    stepped.mkdir()
    recorded(
        stepped,
        "bench_engine",
        {**figures, "peaks_gops": {**figures["peaks_gops"], "int8_step": 160.0}},
        (0.1, 0.1),
    )
    page = report.render_page(report.load_results(stepped / "results"))
    assert "(80 % of the int8 peak here)" in page and "the int8 peak ÷ 0.80." in page
    stream_1k["op_table"]["rows"][0]["pct_of_peak"] = 135.0  # a peak measured low
    low = tmp_path / "low"
    low.mkdir()
    recorded(low, "bench_engine", figures, (0.1, 0.1))
    page = report.render_page(report.load_results(low / "results"))
    assert "**This result's shares of peak are not results:** `experts` ran above 100 %" in page
    plain = tmp_path / "plain"
    plain.mkdir()
    recorded(plain, "bench_engine", engine_figures(stream=3.0), (0.1, 0.1))
    assert "Per-op table" not in report.render_page(report.load_results(plain / "results"))


def test_engine_runs_with_ik_llama_cpp_show_tokens_per_s_and_ratios(tmp_path: Path) -> None:
    """A bench_engine result with ik_llama.cpp runs (``--ik-llama-bench``) shows, under the
    engine table, each prompt's tokens/s of ik, resident and stream, EStream's tokens/s over
    ik's, ik's peak memory and the flags and build it ran with; a length where ik failed shows
    its error; the model, here OLMoE's shapes in qwen3moe's layout, is named with its layout
    and keeps its own section, the README headline staying on the olmoe file; a result
    without ik runs adds no such table."""
    recorded(tmp_path, "bench_engine", engine_figures(stream=3.0), (0.1, 0.1))
    time.sleep(1.1)  # result files are named by the second
    figures = engine_figures(stream=2.0, resident=1.0)  # 1K: 512 and 1024 tokens/s
    figures["model"] = "/c/qwen3moe-olmoe-1b-7b-s0.estream"
    figures["runs"].append({"system": "ik_llama.cpp", "length": 1024, "cgroup": False,
                            "ttft_s": 2.5, "tokens_per_s": 409.6,
                            "peak_memory_bytes": 3 * 2**30})  # fmt: skip
    figures["runs"].append({"system": "ik_llama.cpp", "length": 4096, "cgroup": False,
                            "error": "exit 1"})  # fmt: skip
    figures["ik_llama"] = {"llama_bench": "/x/llama-bench", "args": ["-fa", "1", "-fmoe", "1"],
                           "build_commit": "8337e4c", "build_number": 1}  # fmt: skip
    recorded(tmp_path, "bench_engine", figures, (0.1, 0.1))
    results = report.load_results(tmp_path / "results")
    page = report.render_page(results)
    assert "(olmoe-1b-7b as qwen3moe, q4_0; 1K, 4K)" in page
    assert "(olmoe-1b-7b, q4_0; 1K, 4K)" in page and page.count("**ik_llama.cpp") == 1
    assert "| 1K tokens | 3 s |" in report.headline(results)
    assert "**ik_llama.cpp on the same GGUF**" in page
    assert "`llama-bench -p T -n 0 -r 1 -t 2 -fa 1 -fmoe 1`, ik build 8337e4c" in page
    assert "| 1K | 410 | 1024 | 512 | 2.500 | 1.250 | 3 GiB |" in page
    assert "| 4K | exit 1 | 1024 | 512 | – | – | – |" in page
    plain = tmp_path / "plain"
    plain.mkdir()
    recorded(plain, "bench_engine", engine_figures(), (0.1, 0.1))
    assert "ik_llama.cpp" not in report.render_page(report.load_results(plain / "results"))


def test_engine_io_tax_runs_show_what_the_reads_cost_and_what_streaming_adds(
    tmp_path: Path,
) -> None:
    """A bench_engine result with `--io-tax` runs (`resident+reads`) shows, under the engine
    table, each prompt's achieved read rate, resident alone and beside the reads, their ratio
    (the reads' cost to compute) and stream over resident-beside-reads; a length where that run
    failed shows its error; a result without such runs adds no such table."""
    figures = engine_figures(stream=2.4, resident=2.0)
    figures["runs"].append({"system": "resident+reads", "length": 1024, "cgroup": False,
                            "ttft_s": 2.2, "background_read_bytes_per_s": 800 * 2**20,
                            "peak_memory_bytes": 3 * 2**30})  # fmt: skip
    figures["runs"].append({"system": "resident+reads", "length": 4096, "cgroup": False,
                            "error": "no stream run with reads to take the rate from"})  # fmt: skip
    recorded(tmp_path, "bench_engine", figures, (0.1, 0.1))
    page = report.render_page(report.load_results(tmp_path / "results"))
    assert "**What the reads alone cost compute**" in page
    assert "| 1K | 800 MiB/s | 2 s | 2.2 s | 1.100 | 2.4 s | 1.091 |" in page
    assert (
        "| 4K | – | 8 s | no stream run with reads to take the rate from | – | 9.6 s | – |" in page
    )
    plain = tmp_path / "plain"
    plain.mkdir()
    recorded(plain, "bench_engine", engine_figures(), (0.1, 0.1))
    assert "What the reads alone" not in report.render_page(report.load_results(plain / "results"))


def test_engine_pairs_show_the_median_ratio_and_its_range(tmp_path: Path) -> None:
    """A bench_engine result with `--pairs` runs shows, under the engine table, per length the
    number of pairs (the main runs' included), each side's median time, the median of the
    pairs' stream ÷ resident with its range, and the steal summed per side; the pair runs add
    no column to the engine table, and the run is its own variant. The README headline shows
    the medians over the pairs, not the first pair's figures."""
    figures = engine_figures(stream=2.2, resident=2.0)
    for pair, st, rt in ((1, 2.0, 2.0), (2, 2.05, 2.0)):
        for system, t in (("stream, pair", st), ("resident, pair", rt)):
            figures["runs"].append({"system": system, "length": 1024, "cgroup": False,
                                    "ttft_s": t, "steal_s": 0.1, "pair": pair})  # fmt: skip
    figures["summary"] = [{"length": 1024, "stream_over_resident_pairs": [1.1, 1.0, 1.025]}]
    recorded(tmp_path, "bench_engine", figures, (0.1, 0.1))
    page = report.render_page(report.load_results(tmp_path / "results"))
    assert "**Stream against resident over pairs of runs**" in page
    assert "| 1K | 3 | 2.05 s | 2 s | 1.025 [1.000..1.100] | 0.7 / 0.7 s |" in page
    assert "| 4K | 1 |" not in page  # no pairs recorded at 4K
    assert "| 1K | 2.2 s | 2 s | 8 s | 1.100 |" in page  # the main runs' row, as without pairs
    assert "(olmoe-1b-7b, q4_0; 1K, 4K; 3 pairs)" in page
    # the README headline takes the medians over the pairs where there are pairs
    head = report.headline(report.load_results(tmp_path / "results"))
    assert "| 1K tokens | 2.05 s | 2 s | 8 s | 1.025 (median of 3 pairs) | 0.256 |" in head
    assert "| 4K tokens | 8.8 s | 8 s | 32 s | 1.100 | 0.275 |" in head
    plain = tmp_path / "plain"
    plain.mkdir()
    recorded(plain, "bench_engine", engine_figures(), (0.1, 0.1))
    assert "over pairs of runs" not in report.render_page(report.load_results(plain / "results"))


def test_engine_read_cap_runs_show_each_choice_at_each_disk_speed(tmp_path: Path) -> None:
    """A bench_engine result with `--read-cap` runs shows, under the engine table, the stream
    run chosen with the default read margin and without one, at the disk's own speed and under
    the cap, each with its G, Q, B, its wait for reads and its time over resident's; a result
    without such runs adds no such table, and the run is its own variant."""
    figures = engine_figures(stream=2.4, resident=2.0)
    for r in figures["runs"]:
        if r["system"] == "stream":
            r.update(G=8, Q=1, B=5, expert_stall_s=0.08)
    for system, t, g, b, wait in (
        (report.NO_MARGIN, 2.3, 32, 2, 0.02),
        (report.CAPPED, 2.5, 8, 5, 0.1),
        (report.CAPPED_NO_MARGIN, 3.0, 32, 2, 0.6),
    ):
        figures["runs"].append({"system": system, "length": 1024, "cgroup": False, "ttft_s": t,
                                "G": g, "Q": 1, "B": b, "expert_stall_s": wait,
                                "read_cap_bytes_per_s": 2 * 2**30})  # fmt: skip
    recorded(tmp_path, "bench_engine", figures, (0.1, 0.1))
    page = report.render_page(report.load_results(tmp_path / "results"))
    assert "**A disk slower than profiled**" in page
    assert "| 1K | as it is | 0.5 | 8, 1, 5 | 2.4 s | 0.08 s | 1.200 |" in page
    assert "| 1K | as it is | 0 | 32, 1, 2 | 2.3 s | 0.02 s | 1.150 |" in page
    assert "| 1K | capped at 2 GiB/s | 0.5 | 8, 1, 5 | 2.5 s | 0.10 s | 1.250 |" in page
    assert "| 1K | capped at 2 GiB/s | 0 | 32, 1, 2 | 3 s | 0.60 s | 1.500 |" in page
    assert "| 4K | as it is | 0.5 | 8, 1, 5 | 9.6 s | 0.08 s | 1.200 |" in page
    assert "(olmoe-1b-7b, q4_0; 1K, 4K; reads capped)" in page
    assert "Per-op tables" not in page  # no run of this result has one
    plain = tmp_path / "plain"
    plain.mkdir()
    recorded(plain, "bench_engine", engine_figures(), (0.1, 0.1))
    assert "slower than profiled" not in report.render_page(report.load_results(plain / "results"))


def test_the_headline_skips_a_newer_loaded_run(tmp_path: Path) -> None:
    """The README headline shows the newest bench_engine run not taken on a loaded machine; a
    newer loaded run appears on the page (marked) but does not replace the headline."""
    recorded(tmp_path, "bench_engine", engine_figures(stream=3.0), (0.1, 0.1))
    time.sleep(1.1)  # result files are named by the second
    recorded(tmp_path, "bench_engine", engine_figures(stream=5.0), (0.1, 99.0))
    results = report.load_results(tmp_path / "results")
    assert "| 1K tokens | 3 s |" in report.headline(results)
    assert "| 1K | 5 s |" in report.render_page(results)
    time.sleep(1.1)
    recorded(tmp_path, "bench_engine", engine_figures(stream=2.5), (0.1, 0.1))
    assert "| 1K tokens | 2.5 s |" in report.headline(report.load_results(tmp_path / "results"))


@pytest.mark.parametrize(
    ("field", "value", "systems", "variant", "args"),
    [
        ("attention", "bf16-pv", ("stream", "resident"), "attention bf16-pv",
         "--attention bf16-pv"),
        ("attention", "f32", ("stream", "resident"), "", "--attention=f32"),
        ("pinned_bytes", 810 << 20, ("stream",), "pinned experts", "--pin 810MiB"),
    ],
    ids=["attention", "attention-f32", "pin"],
)  # fmt: skip
def test_the_headline_keeps_to_the_engine_defaults(
    tmp_path: Path, field: str, value: object, systems: tuple[str, ...], variant: str, args: str
) -> None:
    """A newer bench_engine run off the engine's defaults (attention products asked for,
    `--attention bf16-pv` or `--attention=f32`; pinned experts, `--pin`) has its own section on
    the page (f32, what ran before auto was the default, shares the default's); the README
    headline stays on the run with the defaults (attention as the engine picks it, here its
    bf16, nothing pinned)."""
    default = engine_figures(stream=3.0)
    for r in default["runs"]:
        if r["system"] in ("stream", "resident"):
            r["attention"] = "bf16"
    recorded(tmp_path, "bench_engine", default, (0.1, 0.1), "--attention auto")
    time.sleep(1.1)  # result files are named by the second
    other = engine_figures(stream=2.5)
    for r in other["runs"]:
        if r["system"] in systems:
            r[field] = value
    recorded(tmp_path, "bench_engine", other, (0.1, 0.1), args)
    results = report.load_results(tmp_path / "results")
    assert "| 1K tokens | 3 s |" in report.headline(results)
    page = report.render_page(results)
    assert "(olmoe-1b-7b, q4_0; 1K, 4K; attention bf16)" in page
    assert f"(olmoe-1b-7b, q4_0; 1K, 4K{'; ' + variant if variant else ''})" in page
    assert "| 1K | 3 s |" in page and "| 1K | 2.5 s |" in page


def test_each_engine_model_and_quantization_keeps_its_own_section(tmp_path: Path) -> None:
    """bench_engine runs of another quantization (or model) do not replace each other on the
    page: the newest of each is shown under its own label, and the README headline stays on
    the OLMoE-shaped Q4_0 model even when a Q4_K_M run is newer."""
    recorded(tmp_path, "bench_engine", engine_figures(stream=3.0), (0.1, 0.1))
    time.sleep(1.1)  # result files are named by the second
    q4km = {**engine_figures(stream=5.0), "quant": "q4_k_m",
            "model": "/c/olmoe-olmoe-1b-7b-s0-q4_k_m.estream"}  # fmt: skip
    recorded(tmp_path, "bench_engine", q4km, (0.1, 0.1))
    results = report.load_results(tmp_path / "results")
    page = report.render_page(results)
    assert (
        "## bench_engine: End-to-end prefill: stream vs resident vs llama.cpp "
        "(olmoe-1b-7b, q4_0; 1K, 4K)" in page
    )
    assert "(olmoe-1b-7b, q4_k_m; 1K, 4K)" in page
    assert "| 1K | 3 s |" in page and "| 1K | 5 s |" in page
    assert "| 1K tokens | 3 s |" in report.headline(results)


def test_parity_runs_of_other_rows_are_kept_and_covered_ones_replaced(tmp_path: Path) -> None:
    """A parity run of a few rows does not hide the whole table; an older run whose rows a
    newer run all has is replaced by it."""

    def rows(*pairs: tuple[str, str], err: float) -> dict[str, Any]:
        return {"tokens": 256, "rows": [
            {"arch": a, "variant": v, "llamacpp_vs_ref": {"rel_l2": err, "top1": 1.0}}
            for a, v in pairs
        ]}  # fmt: skip

    recorded(tmp_path, "parity", rows(("olmoe", "q4_0"), err=0.011), (0.1, 0.1))
    time.sleep(1.1)
    recorded(
        tmp_path, "parity", rows(("olmoe", "q4_0"), ("mixtral", "q4_0"), err=0.022), (0.1, 0.1)
    )
    time.sleep(1.1)
    recorded(tmp_path, "parity", rows(("olmoe", "lq4_k_m"), err=0.033), (0.1, 0.1))
    page = report.render_page(report.load_results(tmp_path / "results"))
    assert page.count("## parity:") == 2
    assert "2.2e-02" in page and "3.3e-02" in page and "1.1e-02" not in page


def test_parity_over_several_prompts_shows_engine_minus_llama_cpp_with_its_interval(
    tmp_path: Path,
) -> None:
    """A parity run over several prompts shows, beside the engine's q8 figures, its top-1
    agreement minus llama.cpp's and its error ratio with their 95% intervals, and says that the
    errors are geometric means over that many prompts; a one-prompt run shows neither."""
    figures = {"tokens": 256, "prompts": 8, "rows": [
        {"arch": "olmoe", "variant": "q4_0", "engine_act": "q8",
         "engine_vs_ref": {"rel_l2": 0.0117, "top1": 0.974},
         "llamacpp_vs_ref": {"rel_l2": 0.0139, "top1": 0.976},
         "engine_minus_llamacpp": {"n_prompts": 8, "top1_diff": -0.0024,
                                   "top1_diff_ci95": [-0.0068, 0.0015], "rel_l2_ratio": 0.843,
                                   "rel_l2_ratio_ci95": [0.83, 0.856]}}]}  # fmt: skip
    recorded(tmp_path, "parity", figures, (0.1, 0.1))
    page = report.render_page(report.load_results(tmp_path / "results"))
    assert (
        "| 1.2e-02 (0.974); vs llama.cpp: top-1 -0.002 [-0.007, +0.002], error ×0.84 "
        "[0.83, 0.86] |" in page
    )
    assert "256 random tokens × 8 prompts" in page and "geometric mean over prompts" in page

    one = {"tokens": 256, "rows": [{**figures["rows"][0], "variant": "lq4_0"}]}
    del one["rows"][0]["engine_minus_llamacpp"]
    table = report.render_parity(one)
    assert table.rows[0][3] == "1.2e-02 (0.974)"
    assert not any("prompts" in n for n in table.notes)


def test_an_attention_only_kernel_run_keeps_the_kernel_table(tmp_path: Path) -> None:
    """`bench_kernels -- --attention` writes only attention rows: it is shown beside the newest
    whole kernel table, not instead of it."""

    def rows(*ops: str) -> dict[str, Any]:
        return {"rows": [{"op": o, "htp_gflops": 100, "pct_of_best_peak": 50, "peak_kind": "fp32",
                          "blas_gflops": 10, "blas_1thread_gflops": None,
                          "speedup_vs_best_blas": 10.0} for o in ops]}  # fmt: skip

    recorded(tmp_path, "bench_kernels", rows("fused expert op, q8", "attention X"), (0.1, 0.1))
    time.sleep(1.1)
    recorded(tmp_path, "bench_kernels", rows("attention Y T=4096 f32"), (0.1, 0.1))
    page = report.render_page(report.load_results(tmp_path / "results"))
    assert page.count("## bench_kernels:") == 2
    assert "fused expert op, q8" in page and "attention Y T=4096 f32" in page


def test_kernel_rows_with_the_int8_step_ceiling_show_their_share_of_it() -> None:
    """A kernel run that measured the int8 dot product in the Q4_0 / Q8_0 kernels' mix shows each
    such row's share of that ceiling in a column of its own (a dash for the other rows) and says
    what the ceiling is; a run without it keeps the table it had."""
    row = {"op": "gemm q4_0", "htp_gflops": 600.0, "blas_gflops": 150.0,
           "blas_1thread_gflops": None, "speedup_vs_best_blas": 4.0, "peak_kind": "int8",
           "pct_of_best_peak": 64.0}  # fmt: skip
    other = {**row, "op": "gemm q4_k", "pct_of_best_peak": 50.0}
    figures = {"rows": [{**row, "pct_of_best_step": 74.1}, other],
               "peaks_best": {"int8": 937.0, "int8_step": 810.0, "bf16": None}}  # fmt: skip
    table = report.render_kernels(figures)
    assert table.headers[3] == "share of int8_step"
    assert table.rows[0][2:4] == ["64 % int8", "74 %"] and table.rows[1][3] == "–"
    assert any("int8_step" in n and "16 dot products" in n for n in table.notes)
    assert "int8_step 810" in table.notes[0] and "bf16" not in table.notes[0]
    plain = report.render_kernels({"rows": [row]})
    assert "share of int8_step" not in plain.headers and len(plain.rows[0]) == 5


def test_the_newest_result_is_rendered(tmp_path: Path) -> None:
    """Of several results of one benchmark the page shows the newest by date, and a recorded
    run is newer than a transcribed one of the same day."""
    recorded(tmp_path, "bench_engine", engine_figures(stream=3.0), (0.1, 0.1))
    results = report.load_results(tmp_path / "results")
    _, new = report.latest(results["bench_engine"])
    old = {**new, "date": "2000-01-01T00:00:00Z", "figures": engine_figures(stream=7.0)}
    same_day = {**new, "transcribed": True, "date": new["date"][:10], "load_average_1min": None,
                "source": {"file": "README.md", "commit": "0" * 40}, "note": "n"}  # fmt: skip
    for name, doc in (("20000101T000000Z-a.json", old), ("29991231-transcribed.json", same_day)):
        (tmp_path / "results" / "bench_engine" / name).write_text(json.dumps(doc))
    results = report.load_results(tmp_path / "results")
    assert report.latest(results["bench_engine"])[1]["figures"] == new["figures"]
    assert "| 1K | 3 s |" in report.render_page(results)


def test_every_benchmark_session_is_recorded_and_rendered() -> None:
    """Every session that runs a benchmark script through `_bench` (and the bench_hexagon
    session's two, the bench_arm64 session's one) has a figures file in record.BENCHES and a
    renderer in report.BENCHES, and nothing else does."""
    nox_src = (ROOT / "noxfile.py").read_text()
    sessions = set(re.findall(r"def (\w+)\(session: nox.Session\) -> None:\n(?:.*\n){0,4}?"
                              r"\s+_bench\(session", nox_src))  # fmt: skip
    assert {"bench_engine", "bench_kernels", "parity", "eval_parity"} <= sessions
    assert sessions | {"bench_hexagon", "hexagon_packets", "neon_instr_mix"} == set(record.BENCHES)
    assert set(report.BENCHES) == set(record.BENCHES)


def test_committed_page_and_headline_are_what_the_results_render() -> None:
    """docs/benchmarks.md and README.md's headline block are exactly what the committed
    results in benchmarks/results/ render to (`bench_report --check`), so neither can drift;
    rendering twice gives the same text."""
    results = report.load_results()
    page = report.render_page(results)
    assert page == report.render_page(report.load_results())
    assert report.PAGE.read_text() == page
    readme = report.README.read_text()
    assert report.replace_between(readme, report.headline(results), "README.md") == readme
    assert report.main(["--check"]) == 0


def test_the_page_is_a_function_of_the_result_files(tmp_path: Path) -> None:
    """The committed results copied elsewhere render to the same page byte for byte (nothing
    from the clock, the machine or the checkout enters it)."""
    shutil.copytree(record.RESULTS, tmp_path / "results")
    assert report.render_page(report.load_results(tmp_path / "results")) == (
        report.render_page(report.load_results())
    )


@pytest.mark.parametrize(
    "text",
    [
        "# R\n\nno markers\n",
        f"# R\n{report.HEADLINE_END}\nold\n{report.HEADLINE_START}\n",
        f"# R\n{report.HEADLINE_START}\nold\n",
        f"{report.HEADLINE_START}\n{report.HEADLINE_END}\n{report.HEADLINE_START}\n",
    ],
)
def test_missing_markers_are_one_clear_error_and_nothing_is_written(
    tmp_path: Path, text: str
) -> None:
    """A README without exactly one start marker followed by one end marker: exit status 2,
    one line naming the file and both markers, no traceback, and neither file written."""
    readme, page = tmp_path / "README.md", tmp_path / "benchmarks.md"
    readme.write_text(text)
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "report.py"), "--readme", str(readme),
         "--page", str(page)], capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 2
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"bench_report: error: {readme}: ")
    assert report.HEADLINE_START in err[0] and report.HEADLINE_END in err[0]
    assert readme.read_text() == text and not page.exists()
    assert not list(tmp_path.glob("*.tmp"))


def test_report_rewrites_only_between_the_markers(tmp_path: Path) -> None:
    """bench_report replaces the headline between the markers and leaves the rest of the README
    as it was, byte for byte."""
    readme, page = tmp_path / "README.md", tmp_path / "benchmarks.md"
    readme.write_text(f"# R\nbefore\n{report.HEADLINE_START}\nold table\n{report.HEADLINE_END}\n"
                      "after\n")  # fmt: skip
    assert report.main(["--readme", str(readme), "--page", str(page)]) == 0
    text = readme.read_text()
    assert text.startswith(f"# R\nbefore\n{report.HEADLINE_START}\n| prompt |")
    assert text.endswith(f"{report.HEADLINE_END}\nafter\n") and "old table" not in text
    assert page.read_text() == report.PAGE.read_text()


def test_transcribed_results_are_marked() -> None:
    """Every committed transcribed result names its source and shows as transcribed with its
    load average not recorded; one whose text states a high load is also marked loaded."""
    results = report.load_results()
    transcribed = [d for v in results.values() for _, d in v if d["transcribed"]]
    assert transcribed
    for doc in transcribed:
        assert doc["source"]["file"] and len(doc["source"]["commit"]) == 40
        assert "transcribed; load average not recorded" in report.status(doc)
        stated = doc.get("stated_load_average")
        high = bool(stated) and max(stated) / doc["machine"]["cores"] > report.LOADED_PER_CORE
        assert ("loaded machine" in report.status(doc)) is high


def _run(system: str, **kw: Any) -> dict[str, Any]:
    return {"system": system, **kw}


#: Each benchmark's figures in its script's output shape (the keys its renderer reads), and the
#: start of a row the rendered table must hold.
FIGURES: dict[str, tuple[dict[str, Any], str]] = {
    "bench_engine": (engine_figures(), "| 1K | 2 s | 4 s | 8 s | 0.500 | 0.250 |"),
    "bench_tasks": (
        {"threads": 2, "cold": "fadvise", "sets": [{
            "name": "MASSIVE", "requests": 64, "mean_tokens": 15.25,
            "runs": [_run("stream-batched", wall_s=32.0, run_s=16.0, passes=1,
                          peak_memory_bytes=700 * 2**20, load="1.00 0.90 0.80"),
                     _run("llama.cpp", error="OOM-killed", load="1.00 0.90 0.80")],
            "ratios": {"stream (warm)": 7.5}}]},
        "| MASSIVE (15.2) | stream-batched | 2 | 4 | 1 | 700 MiB | 1.00 0.90 0.80 |",
    ),
    "bench_ray": (
        {"rows": 128, "labels": 60, "mean_words": 8.1, "preset": "olmoe-1b-7b",
         "block_rows": 32, "cold": "fadvise",
         "runs": [{"system": "plain", "wall_s": 64.0, "run_s": 32.0, "load": "0.10 0.10 0.10"},
                  {"system": "ray-1", "wall_s": 80.0, "run_s": 35.2, "same_answers": True,
                   "load": "0.20 0.10 0.10"},
                  {"system": "ray-2", "error": "exit 1: no ray", "load": "0.20 0.10 0.10"}],
         "overhead_one_actor_run": 0.1, "overhead_one_actor_wall": 0.25},
        "| ray-1 | 1.6 | 3.64 | yes | 0.20 0.10 0.10 |",
    ),
    "bench_vs_llama": (
        {"gguf": "/x/m.gguf", "tokens": 40, "threads": 2,
         "runs": {"llama-bench": [{}, {}], "stream": [{}, {}]},
         "summary": {"llama-bench": {"tokens_per_s_median": 250.0, "peak_rss_mib_median": 100.0},
                     "stream": {"tokens_per_s_median": 125.0, "peak_rss_mib_median": 50.0,
                                "over_llama_bench_median": 0.5,
                                "over_llama_bench_range": [0.4, 0.6]}}},
        "| stream | 125 | 0.50 (0.40–0.60) | 50 MiB |",
    ),
    "bench_scale": (
        {"presets": {"qwen3-30b-a3b": {"runs": [
            _run("stream", length=1024, ttft_s=64.0, peak_memory_bytes=2**31),
            _run("llama.cpp", length=1024, error="OOM-killed")]}}},
        "| qwen3-30b-a3b | 1K | 64 s | 16 | 2 GiB | – | – | OOM-killed | – |",
    ),
    "bench_kernels": (
        {"rows": [{"op": "gemm", "htp_gflops": 612.0, "blas_gflops": 150.0,
                   "blas_1thread_gflops": 161.0, "speedup_vs_best_blas": 3.8,
                   "peak_kind": "int8", "pct_of_peak": 60.0, "pct_of_best_peak": 67.2}],
         "peaks_best": {"int8": 909.0}},
        "| gemm | 612 | 67 % int8 | 161 | 3.8× |",
    ),
    "bench_arena": (
        {"points": [{"G": 1, "Q": 1, "bytes_per_s": 1161e6, "ratio_to_dd": 1.14}],
         "merged_points": [], "q0_per_g": {"1": 1}, "dd_bytes_per_s": 1018e6,
         "dd_best_bs": "64M", "file_bytes": 2e9, "repeat": 3},
        "| 1 | 1161 (1.14×) | 1 |",
    ),
    "bench_layout": (
        {"arch": "olmoe", "preset": "tiny", "source_bytes": 2**30, "expert_bytes": 2**29,
         "write_seconds": 1.0, "write_mb_per_s": 1000.0, "copy_seconds": 1.0,
         "copy_mb_per_s": 500.0, "convert_seconds": 1.0, "convert_mb_per_s": 800.0,
         "pack_seconds": 2.0, "pack_expert_mb_per_s": 250.0, "verify_seconds": 1.0,
         "verify_mb_per_s": 400.0, "pack_peak_rss_mib": 397.0, "met": False},
        "| **pack, end to end** | 2.0 s | 250 | 0.25 |",
    ),
    "bench_sched": (
        {"selection_warm": {"median_ms": 0.53, "p99_ms": 0.78, "cpu_median_ms": 0.5,
                            "cpu_p99_ms": 0.7, "n": 400},
         "selection_cold": {"median_ms": 13.5, "p99_ms": 19.0, "cpu_median_ms": 12.0,
                            "cpu_p99_ms": 18.0, "n": 50},
         "baseline_one_candidate_at_a_time": {"median_ms": 17.1, "p99_ms": 30.0,
                                              "cpu_median_ms": 16.0, "cpu_p99_ms": 29.0,
                                              "n": 50}},
        "| `configure`, warm profile | 0.53 ms | 0.78 ms | 0.5 ms | 0.7 ms | 400 |",
    ),
    "bench_tokenizer": (
        {"text_kib": 300, "repeat": 3, "rows": [{
            "vocab": "qwen2", "corpus": "mixed", "tokens": 1000, "estream_cold_tok_s": 5e5,
            "estream_warm_tok_s": 6e5, "hf_tok_s": 1e6, "estream_cold_vs_hf": 0.5,
            "hf_agrees": True, "llama_cpp_agrees": None}]},
        "| qwen2 | mixed | 1000 | 500000 | 600000 | 1000000 | – | 0.5 | – | HF yes, llama.cpp – |",
    ),
    "parity": (
        {"tokens": 256, "rows": [
            {"arch": "olmoe", "variant": "lq4_0", "engine_act": "q8",
             "engine_vs_ref": {"rel_l2": 0.0123, "top1": 0.98},
             "llamacpp_vs_ref": {"rel_l2": 0.0111, "top1": 0.97},
             "ref_vs_src": {"rel_l2": 0.17}, "engine_vs_src": {"rel_l2": 0.18},
             "llamacpp_vs_src": {"rel_l2": 0.16}},
            {"arch": "olmoe", "variant": "lq4_0", "engine_act": "f32",
             "engine_vs_ref": {"rel_l2": 0.0053, "top1": 0.99},
             "engine_vs_packed_ref": {"rel_l2": 5.3e-7, "top1": 1.0},
             "llamacpp_vs_ref": {"rel_l2": 0.0111, "top1": 0.97}}]},
        "| olmoe | `lq4_0` | 1.1e-02 (0.970) | 1.2e-02 (0.980) | 5.3e-03 (0.990) | "
        "5.3e-07 (1.000) | 1.7e-01 / 1.8e-01 / 1.6e-01 |  |",
    ),
    "eval_parity": (
        {"text": "docs/design.md", "chars": 4000, "rows": [{
            "arch": "olmoe", "ctx": 128, "windows": 7,
            "estream": {"perplexity": 10.0, "perplexity_stderr": 0.5},
            "llama_cpp": {"perplexity": 10.01, "perplexity_stderr": 0.5}, "ppl_ratio": 0.999,
            "nll_diff_mean": -0.001, "nll_diff_stderr": 0.002, "top1_agreement": 0.99}]},
        "| olmoe | 128 | 7 | 10 ± 0.5 | 10.01 ± 0.5 | 0.9990 | -0.00100 ± 0.00200 | 0.990 |",
    ),
    "bench_hexagon": (
        {"c_host": {"median_us": 0.7, "p10_us": 0.6, "p90_us": 0.9},
         "start_s": {"host": 0.0002}},
        "| C call `htp_op_run` | 0.7 µs (0.6–0.9) | – | – |",
    ),
    "hexagon_packets": (
        {"executor": "/x", "hvx": {"per_tile_setup": 40.0, "per_tile_per_token": 10.0,
                                   "per_tile": {"1": 50.0, "8": 120.0, "64": 680.0}}},
        "| hvx | 40 | 10 | 50 / 120 / 680 |",
    ),
    "neon_instr_mix": (
        {"executable": "built", "neon_i8mm_q4_k": {
            "function": "q4kq8_strip_i8mm", "format": "q4_k", "table": "neon_i8mm", "cpu": "max",
            "per_tile_per_token": {"sdot": 0, "mmla": 32, "load": 48, "store": 16, "fp": 20.5,
                                   "convert": 12, "int_vector": 63, "branch": 1.25,
                                   "scalar": 12, "total": 224.25},
            "per_tile": {
                "1": {"sdot": 64, "mmla": 0, "total": 311},
                "2": {"sdot": 0, "mmla": 64, "total": 468},
                "4": {"sdot": 0, "mmla": 128, "total": 897},
                "8": {"sdot": 0, "mmla": 256, "total": 1794}}}},
        "| `q4kq8_strip_i8mm` | neon_i8mm, q4_k, max | 311 / 468 / 897 / 1794 | 224 | "
        "0 / 32 / 48 / 16 / 20.5 / 12 / 63 / 13.2 |",
    ),
}  # fmt: skip


def test_neon_mix_shows_the_attention_tasks_beside_the_strip_kernels() -> None:
    """neon_instr_mix's attention entries (per_key_block, no per_tile) become a second table
    under the strip kernels', one row per task, and do not disturb the strip table."""
    strip, row = FIGURES["neon_instr_mix"]
    block = {"sdot": 0, "mmla": 0, "bf16": 131072, "load": 60000, "store": 34000, "fp": 280000,
             "convert": 1088, "int_vector": 377000, "branch": 7000, "scalar": 30000}  # fmt: skip
    att = {"function": "htp_attn_bf16_task_neon", "products": "bf16", "table": "neon", "dk": 64,
           "dv": 64, "queries": 64, "measured": {"nkb=1": {"total": 968283}, "nkb=2": {}},
           "per_key_block": {**block, "total": 920160}}  # fmt: skip
    table = report.BENCHES["neon_instr_mix"].render({**strip, "attention_neon_bf16": att})
    assert any(line.startswith(row) for line in table.markdown())
    assert len(table.rows) == 1 and len(table.more) == 1
    caption, sub = table.more[0]
    assert "dk = dv = 64" in caption
    assert all(len(r) == len(sub.headers) for r in sub.rows)
    assert sub.markdown()[2] == (
        "| `htp_attn_bf16_task_neon` | neon, bf16 | 968283 | 920160 | "
        "131072 / 60000 / 34000 / 280000 / 1088 / 377000 / 37000 |"
    )
    # a result file from before the attention entries renders no second table
    assert not report.BENCHES["neon_instr_mix"].render(strip).more


def test_a_cell_with_a_bar_or_line_break_stays_one_cell() -> None:
    """An error message holding '|' or a line break does not split or end its table row."""
    t = report.Table(["a", "b"], [["exit 1: x | y\nz", "ok"]])
    assert t.markdown()[2] == "| exit 1: x \\| y z | ok |"


@pytest.mark.parametrize("bench", sorted(record.BENCHES))
def test_each_renderer_makes_a_well_formed_table(bench: str) -> None:
    """Each benchmark's renderer turns figures of its script's shape into a table whose rows
    have as many cells as the header, with the figures (formatted) in the expected cells."""
    figures, row = FIGURES[bench]
    table = report.BENCHES[bench].render(figures)
    assert table.rows and all(len(r) == len(table.headers) for r in table.rows)
    assert any(line.startswith(row) for line in table.markdown())


@pytest.mark.parametrize(
    ("model", "quant", "variant"),
    [
        ("olmoe-olmoe-1b-7b-s0.estream", "q4_0", "olmoe-1b-7b, q4_0"),
        ("olmoe-olmoe-1b-7b-s0-q4_k_m.estream", "q4_k_m", "olmoe-1b-7b, q4_k_m"),
        ("deepseek2-deepseek-v2-lite-s0.estream", "q4_0", "deepseek-v2-lite, q4_0"),
        ("gpt-oss-gpt-oss-20b-s0.estream", "q4_0", "gpt-oss-20b, mxfp4 experts"),
        ("smallthinker-smallthinker-4b-a0.6b-s0.estream", "q4_0", "smallthinker-4b-a0.6b, q4_0"),
    ],
)
def test_engine_results_are_told_apart_by_model(model: str, quant: str, variant: str) -> None:
    """bench_engine's variant (which result of a model the page keeps) reads the preset from the
    cached model's name whatever dashes its family or preset holds, and says when the preset's
    own experts are not Q4_0: a SmallThinker run is not taken for an OLMoE one."""
    figures = {"model": f"/cache/models/{model}", "quant": quant}
    assert report.engine_model(figures) == variant


def test_engine_results_of_other_lengths_are_kept_apart() -> None:
    """A model's bench_engine runs of other prompt lengths, or with memory-capped runs, are
    other variants (a 4K run does not push the same model's 256/1K and cgroup figures off the
    page); runs of the same lengths are one variant (the newer replaces the older)."""

    def figures(free: list[int], capped: list[int]) -> dict[str, object]:
        runs = [{"system": "stream", "length": T} for T in free]
        runs += [{"system": "stream", "length": T, "cgroup": True} for T in capped]
        return {"model": "/m/gpt-oss-gpt-oss-20b-s0.estream", "quant": "q4_0", "runs": runs}

    a = report.engine_variant(figures([256, 1024], [1024]))
    b = report.engine_variant(figures([4096], []))
    c = report.engine_variant(figures([1024, 256], [1024]))
    assert a == "gpt-oss-20b, mxfp4 experts; 256, 1K; capped 1K"
    assert b == "gpt-oss-20b, mxfp4 experts; 4K"
    assert a == c and a != b


def test_engine_results_with_other_attention_products_are_kept_apart() -> None:
    """A bench_engine run with `--attention bf16-pv` is its own variant: it sits beside the
    same model's and lengths' fp32-attention run instead of replacing it (runs from before the
    engine reported its attention count as fp32)."""

    def figures(attention: str | None) -> dict[str, object]:
        runs = [{"system": s, "length": 1024} for s in ("stream", "resident", "llama.cpp")]
        for r in runs[:2]:
            if attention:
                r["attention"] = attention
        return {"model": "/m/olmoe-olmoe-1b-7b-s0.estream", "quant": "q4_0", "runs": runs}

    assert report.engine_variant(figures(None)) == report.engine_variant(figures("f32"))
    assert report.engine_variant(figures("f32")) == "olmoe-1b-7b, q4_0; 1K"
    assert report.engine_variant(figures("bf16-pv")) == "olmoe-1b-7b, q4_0; 1K; attention bf16-pv"


def test_engine_results_with_pinned_experts_are_kept_apart() -> None:
    """A bench_engine run with `--pin` is its own variant (beside the run without pins), its
    stream row names the bytes pinned, and a note says what pinning did."""

    def figures(pinned: int) -> dict[str, object]:
        runs = [
            {"system": s, "length": 1024, "ttft_s": 2.0, "G": 8, "Q": 1, "B": 3}
            for s in ("stream", "resident", "llama.cpp")
        ]
        runs[0]["pinned_bytes"] = pinned
        return {"model": "/m/olmoe-olmoe-1b-7b-s0.estream", "quant": "q4_0", "runs": runs}

    assert report.engine_variant(figures(0)) == "olmoe-1b-7b, q4_0; 1K"
    pinned = figures(891 << 20)
    assert report.engine_variant(pinned) == "olmoe-1b-7b, q4_0; 1K; pinned experts"
    table = report.render_engine(pinned)
    assert table.rows[0][-1] == "8, 1, 3; 891 MiB pinned"
    assert any("`stream` with `--pin`" in n for n in table.notes)
    assert report.render_engine(figures(0)).rows[0][-1] == "8, 1, 3"


def test_engine_results_with_the_reads_cost_are_kept_apart() -> None:
    """A bench_engine run with `--io-tax` (a `resident+reads` run) is its own variant: it sits
    beside the same model's and lengths' run without it instead of replacing it."""
    runs = [{"system": s, "length": 1024} for s in ("stream", "resident", "llama.cpp")]
    plain = {"model": "/m/olmoe-olmoe-1b-7b-s0.estream", "quant": "q4_0", "runs": runs}
    taxed = {**plain, "runs": [*runs, {"system": report.IO_TAX, "length": 1024}]}
    assert report.engine_variant(plain) == "olmoe-1b-7b, q4_0; 1K"
    assert report.engine_variant(taxed) == "olmoe-1b-7b, q4_0; 1K; the reads' cost"


def test_the_ray_note_names_the_blocks_given_or_the_commands_default() -> None:
    """bench_ray's note gives the rows of a block when the run set ``--block-rows`` and says
    the rows were shared between the actors when it used the command's default (no count)."""
    figures = dict(FIGURES["bench_ray"][0])
    given = " ".join(report.render_ray(figures).notes)
    figures["block_rows"] = None
    default = " ".join(report.render_ray(figures).notes)
    assert "blocks of 32 rows" in given and "shared evenly" not in given
    assert "the rows shared evenly between the actors" in default and "blocks of" not in default


def test_parity_with_bf16_attention_shows_its_error_its_ratio_and_a_verdict() -> None:
    """A run with `--engine-attention f32,bf16` gets a column of the engine q8 error with bf16
    attention and its ratio to the fp32-attention error, and a one-line verdict: every row
    within 5 %, or the rows over it by name; a run without bf16 rows keeps the old columns."""

    def run(*bf16_over_f32: float) -> dict[str, Any]:
        rows = []
        for i, ratio in enumerate(bf16_over_f32):
            base = {"arch": "olmoe", "variant": f"v{i}", "llamacpp_vs_ref": {"rel_l2": 0.02}}
            rows += [
                {**base, "engine_act": "q8", "engine_attention": "f32",
                 "engine_vs_ref": {"rel_l2": 0.0100, "top1": 0.98}},
                {**base, "engine_act": "q8", "engine_attention": "bf16",
                 "engine_vs_ref": {"rel_l2": 0.0100 * ratio, "top1": 0.97}},
                {**base, "engine_act": "f32", "engine_attention": "f32",
                 "engine_vs_ref": {"rel_l2": 5e-7, "top1": 1.0}},
            ]  # fmt: skip
        return {"tokens": 256, "prompts": 1, "rows": rows}

    t = report.render_parity(run(1.02, 0.9))
    col = t.headers.index("engine q8, bf16 attention vs ref")
    assert t.headers[col - 1] == "engine q8 vs ref" and len(t.rows) == 2
    assert [r[col] for r in t.rows] == [
        "1.0e-02 (0.970); ×1.020 of fp32 attention's",
        "9.0e-03 (0.970); ×0.900 of fp32 attention's",
    ]
    assert [r[col - 1] for r in t.rows] == ["1.0e-02 (0.980)"] * 2
    assert [r[col + 1] for r in t.rows] == ["5.0e-07 (1.000)"] * 2
    assert "every row within 5 % of the fp32-attention error (ratios 0.900–1.020)" in t.notes[-1]

    t = report.render_parity(run(1.02, 1.08, 1.2))
    assert "rows over 5 %: olmoe `v1` ×1.080, olmoe `v2` ×1.200." in t.notes[-1]
    assert "every row within" not in " ".join(t.notes)

    old = run(1.0)  # before --engine-attention: no bf16 rows, no engine_attention field
    old["rows"] = [
        {k: v for k, v in r.items() if k != "engine_attention"}
        for r in old["rows"] if r.get("engine_attention") != "bf16"
    ]  # fmt: skip
    t = report.render_parity(old)
    assert "engine q8, bf16 attention vs ref" not in t.headers
    assert t.rows[0][3:5] == ["1.0e-02 (0.980)", "5.0e-07 (1.000)"]
    assert not any("bf16" in n for n in t.notes)


def test_parity_with_both_bf16_modes_has_a_column_and_a_verdict_for_each() -> None:
    """A run with `--engine-attention f32,bf16,bf16-pv`: one column per bf16 mode, each with
    its own ratio to the fp32-attention error, and one verdict line per mode."""
    base = {"arch": "qwen3moe", "variant": "q4_0", "llamacpp_vs_ref": {"rel_l2": 0.02}}
    rows = [
        {**base, "engine_act": "q8", "engine_attention": "f32",
         "engine_vs_ref": {"rel_l2": 0.0100, "top1": 0.98}},
        {**base, "engine_act": "q8", "engine_attention": "bf16",
         "engine_vs_ref": {"rel_l2": 0.0110, "top1": 0.97}},
        {**base, "engine_act": "q8", "engine_attention": "bf16-pv",
         "engine_vs_ref": {"rel_l2": 0.0102, "top1": 0.975}},
        {**base, "engine_act": "f32", "engine_attention": "f32",
         "engine_vs_ref": {"rel_l2": 5e-7, "top1": 1.0}},
    ]  # fmt: skip
    t = report.render_parity({"tokens": 256, "prompts": 1, "rows": rows})
    c1 = t.headers.index("engine q8, bf16 attention vs ref")
    c2 = t.headers.index("engine q8, bf16 P·V attention vs ref")
    assert c2 == c1 + 1 and t.headers[c2 + 1] == "engine f32 vs ref"
    assert t.rows[0][c1] == "1.1e-02 (0.970); ×1.100 of fp32 attention's"
    assert t.rows[0][c2] == "1.0e-02 (0.975); ×1.020 of fp32 attention's"
    assert "bf16 attention (engine q8" in t.notes[-2] and "rows over 5 %: qwen3moe" in t.notes[-2]
    assert t.notes[-1].startswith("bf16 P·V attention (engine q8")
    assert "every row within 5 % of the fp32-attention error (ratios 1.020–1.020)" in t.notes[-1]


def test_parity_bf16_rows_with_per_prompt_errors_get_paired_intervals() -> None:
    """Rows that carry per-prompt errors for both attention modes get the ratio's 95 %
    bootstrap interval over prompts in their cell, and the verdict adds the ratio over every
    prompt of those rows, paired, and names the rows whose interval lies wholly above 5 %; a
    row without per-prompt errors keeps its point ratio and is left out of the pooled one."""
    f32_p = [0.010, 0.012, 0.008, 0.011]
    per_row = {
        "v0": [e * 1.2 for e in f32_p],  # every prompt 20 % worse: [1.2, 1.2], named
        "v1": [e * r for e, r in zip(f32_p, (0.9, 1.1, 0.95, 1.08), strict=True)],  # spans 1
    }
    rows: list[dict[str, Any]] = []
    for variant, bf16_p in [*per_row.items(), ("v2", None)]:
        base = {"arch": "olmoe", "variant": variant, "llamacpp_vs_ref": {"rel_l2": 0.02}}

        def err(p: list[float] | None, scale: float) -> dict[str, Any]:
            if p is None:  # an older run: the geometric mean only
                return {"rel_l2": 0.01 * scale, "top1": 0.97}
            return {"rel_l2": math.exp(sum(map(math.log, p)) / len(p)), "top1": 0.97,
                    "rel_l2_prompts": p}  # fmt: skip

        rows += [
            {**base, "engine_act": "q8", "engine_attention": "f32",
             "engine_vs_ref": err(f32_p if bf16_p else None, 1.0)},
            {**base, "engine_act": "q8", "engine_attention": "bf16-pv",
             "engine_vs_ref": err(bf16_p, 1.3)},
        ]  # fmt: skip
    t = report.render_parity({"tokens": 256, "prompts": 4, "rows": rows})
    col = t.headers.index("engine q8, bf16 P·V attention vs ref")
    cells = {r[1]: r[col] for r in t.rows}
    assert cells["`v0`"].endswith("; ×1.200 [1.200, 1.200] of fp32 attention's")
    lo, hi = map(float, re.search(r"\[(\S+), (\S+)\]", cells["`v1`"]).groups())  # type: ignore[union-attr]
    assert lo < 1.0 < hi < 1.2
    assert cells["`v2`"].endswith("; ×1.300 of fp32 attention's")  # no interval without prompts
    logs = [math.log(b / a) for v in per_row.values() for a, b in zip(f32_p, v, strict=True)]
    pooled = math.exp(sum(logs) / len(logs))
    note = t.notes[-1]
    assert f"Paired over the 8 prompts of 2 rows: ×{pooled:.3f} [" in note
    assert "rows whose interval lies above 5 %: olmoe `v0` [1.200, 1.200]." in note
    assert "v1` [" not in note and "v2` [" not in note
