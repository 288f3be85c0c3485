"""The benchmark scripts on tiny inputs: those that compare against outside programs run
against a stand-in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import estream_htp as htp
from estream_layout import synth_model

ROOT = Path(__file__).resolve().parents[1]

# a llama-bench stand-in: prints llama-bench's JSON for -p N at a known rate, 250 tokens/s
FAKE_LLAMA_BENCH = r"""#!/usr/bin/env python3
import json, sys
a = sys.argv
n = int(a[a.index("-p") + 1])
assert a[a.index("-n") + 1] == "0" and a[a.index("-o") + 1] == "json", a
print("some log line")
print(json.dumps([{"n_prompt": n, "n_gen": 0, "avg_ns": int(n / 250 * 1e9), "avg_ts": 250.0}]))
"""


def test_vs_llama_bench_reports_ratios_per_round(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    synth_model("qwen3moe", "tiny", gguf, seed=3)
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH)
    fake.chmod(0o755)
    out = tmp_path / "r.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "integration" / "bench" / "vs_llama_bench.py"), str(gguf),
         "--llama-bench", str(fake), "--tokens", "40", "--rounds", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert (tmp_path / "m.estream" / "manifest.json").exists()  # packed first
    s = doc["summary"]
    assert s["llama-bench"]["tokens_per_s"] == [250.0, 250.0]
    for mode in ("resident", "stream"):
        runs = doc["runs"][mode]
        assert len(runs) == 2
        ratios = [r["tokens_per_s"] / 250.0 for r in runs]
        assert s[mode]["over_llama_bench_range"] == [min(ratios), max(ratios)]
        assert all(abs(r["tokens_per_s"] - 40 / r["ttft_s"]) < 1e-6 for r in runs)
    assert [r["config"]["config_source"] for r in doc["runs"]["stream"]] == ["default"] * 2
    assert doc["runs"]["resident"][0]["config"] == {}
    assert doc["budget_bytes"] is None
    assert not list(tmp_path.glob("*.tmp"))


def test_vs_llama_bench_budget_streams_under_the_configurators_choice(tmp_path: Path) -> None:
    """--budget profiles the pack first (it has no profile), then every stream run takes the
    configurator's (G, Q, B) for that budget, recorded with the run; a bad budget is refused."""
    gguf = tmp_path / "m.gguf"
    synth_model("qwen3moe", "tiny", gguf, seed=4)
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH)
    fake.chmod(0o755)
    script = str(ROOT / "integration" / "bench" / "vs_llama_bench.py")
    bad = subprocess.run(
        [sys.executable, script, str(gguf), "--llama-bench", str(fake), "--budget", "lots"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert bad.returncode == 2 and "--budget" in bad.stderr and "lots" in bad.stderr
    out = tmp_path / "r.json"
    done = subprocess.run(
        [sys.executable, script, str(gguf), "--llama-bench", str(fake), "--tokens", "24",
         "--rounds", "1", "--modes", "stream", "--budget", "2GiB", "--out", str(out)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "m.estream" / "manifest.json").read_text())
    assert manifest.get("profile")  # profiled first
    doc = json.loads(out.read_text())
    assert doc["budget_bytes"] == 2 << 30
    (run,) = doc["runs"]["stream"]
    cfg = run["config"]
    assert cfg["config_source"] == "budget" and min(cfg["G"], cfg["Q"], cfg["B"]) >= 1
    assert f"G={cfg['G']} Q={cfg['Q']} B={cfg['B']} (budget)" in done.stdout


def test_vs_llama_bench_refuses_a_missing_executable(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    done = subprocess.run(
        [sys.executable, str(ROOT / "integration" / "bench" / "vs_llama_bench.py"), str(gguf)],
        capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 2 and "--llama-bench" in done.stderr


def test_attention_precision_reports_each_mode_per_activation_format(tmp_path: Path) -> None:
    """attention_precision.py: per activation format, the engine's logit error against the
    float64 reference with fp32 attention and each bf16 mode; with f32 activations the fp32
    path matches the reference and both bf16 modes are measurably off it; each mode's verdict
    follows its q8 ratio; a mode that is not one is refused before anything runs."""
    out = tmp_path / "p.json"
    script = ROOT / "integration" / "bench" / "attention_precision.py"
    done = subprocess.run(
        [sys.executable, str(script), "--archs", "olmoe", "--tokens", "24", "--prompts", "1",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert doc["products"] == ["bf16", "bf16-pv"]
    rows = {r["act"]: r for r in doc["rows"]}
    assert set(rows) == {"q8", "f32"} and all(r["arch"] == "olmoe" for r in doc["rows"])
    f32 = rows["f32"]["err"]
    assert f32["f32"] < 1e-5 < min(f32["bf16"], f32["bf16-pv"])
    assert f32["bf16-pv"] != f32["bf16"]
    for r in doc["rows"]:
        for p in ("bf16", "bf16-pv"):
            assert r["ratio"][p] == r["err"][p] / r["err"]["f32"]
    for p in ("bf16", "bf16-pv"):
        assert doc["default_ok"][p] == (rows["q8"]["ratio"][p] <= doc["limit"])
    for argv, msg in (
        (["--tokens", "0"], "--tokens and --prompts must be >= 1"),
        (["--products", "bf16,fp8"], "--products: fp8"),
        (["--products", "f32"], "--products: f32"),
    ):
        bad = subprocess.run(
            [sys.executable, str(script), *argv, "--out", str(tmp_path / "x.json")],
            capture_output=True, text=True,
        )  # fmt: skip
        assert bad.returncode == 2 and msg in bad.stderr, (argv, bad.stderr)
        assert not (tmp_path / "x.json").exists()


def _bench_engine():
    sys.path.insert(0, str(ROOT / "integration" / "bench"))
    import bench_engine

    return bench_engine


def test_bench_engine_peaks_are_bench_kernels_measurement() -> None:
    """bench_engine's peaks come from bench_kernels' `measure_peaks` (run in a child on the
    given threads): a GOP/s figure for int8 and fp32 (bf16 where there is such an instruction,
    int8_step on the AVX-512 VNNI level), and the better of two measurements is kept per
    precision."""
    be = _bench_engine()
    peaks = be.measure_peaks(1)
    assert set(peaks) == {"int8", "fp32", "bf16", "int8_step"}
    assert peaks["int8"] > 0 and peaks["fp32"] > 0
    assert (peaks["int8_step"] is not None) == (htp.simd_level() == "avx512vnni")
    best = be.best_peaks({"int8": 10.0, "fp32": None}, {"int8": 12.0, "fp32": 3.0, "bf16": None})
    assert best == {"bf16": None, "fp32": 3.0, "int8": 12.0}


def test_bench_engine_trace_tables_read_rates_against_the_peaks(capsys) -> None:
    """With ``--trace`` each engine run that has a per-op table gets every rate's share of the
    peak of its precision, and the table is printed; a run without one is left as it was."""
    from estream.opstats import op_table

    be = _bench_engine()
    table = op_table(
        total_s=1.0, n_layers=1, op_spans=[("experts", 0, 0.0, 0.5), ("norm", 0, 0.5, 0.6)],
        op_work=[("experts", 0, "int8", 10**10)],
    )  # fmt: skip
    rows = [
        {"system": "stream", "length": 64, "ttft_s": 1.0, "op_table": table},
        {"system": "llama.cpp", "length": 64, "ttft_s": 2.0},
    ]
    be.print_op_tables(rows, {"int8": 40.0, "fp32": 10.0, "bf16": None})
    got = {r["op"]: r for r in rows[0]["op_table"]["rows"]}
    assert got["experts"]["pct_of_peak"] == 50.0  # 10 GOP in 0.5 s = 20 GOP/s of 40
    assert got["norm"]["pct_of_peak"] is None
    assert "op_table" not in rows[1]
    out = capsys.readouterr().out
    assert "stream T=64" in out and "of peak" in out and "50.0%" in out


def test_bench_engine_ensure_profile_reprofiles_a_stale_profile(tmp_path: Path, capsys) -> None:
    """bench_engine's `ensure_profile` profiles a pack without a profile at the runs' threads,
    reuses a current one (manifest untouched), and re-profiles a stale one (made at other
    threads, or recording nothing) so that it matches this machine and the runs' threads."""
    from estream.config import running_identity, store_profile
    from estream.packed import PackedModel, update_config
    from estream.profiling import profile_model
    from estream_layout import pack_model

    be = _bench_engine()
    synth_model("olmoe", "tiny", tmp_path / "m.gguf", seed=6)
    dst = tmp_path / "m.estream"
    pack_model(tmp_path / "m.gguf", dst, progress=False)
    small = {"candidates": (1, 2), "queue_depths": (1, 2), "n_tokens": 8, "bw_rounds": 1}
    store_profile(PackedModel(dst), profile_model(dst, n_threads=2, **small))
    before = (dst / "manifest.json").read_bytes()
    be.ensure_profile(dst, threads=2)  # current: reused
    assert (dst / "manifest.json").read_bytes() == before
    assert "profiling" not in capsys.readouterr().out
    be.ensure_profile(dst, threads=1)  # measured at 2 threads, the runs use 1
    out = capsys.readouterr().out
    assert "stored profile is stale: threads 2 (profiled) != 1 (now)" in out
    model = PackedModel(dst)
    assert model.manifest["profile"]["measured_with"] == running_identity(model, n_threads=1)
    doc = dict(model.manifest["profile"])
    doc.pop("measured_with")  # a profile from before the record existed
    update_config(dst, "profile", doc)
    be.ensure_profile(dst, threads=1)
    assert "does not record what it was measured with" in capsys.readouterr().out
    model = PackedModel(dst)
    assert model.manifest["profile"]["measured_with"] == running_identity(model, n_threads=1)


# an ik_llama.cpp llama-bench stand-in: logs on stderr, then llama-bench's JSON for -p N at
# 200 tokens/s with the flags it was given; exits 3 when asked to (-p 13)
FAKE_IK_BENCH = r"""#!/usr/bin/env python3
import json, sys
a = sys.argv
n = int(a[a.index("-p") + 1])
assert a[a.index("-n") + 1] == "0" and a[a.index("-r") + 1] == "1", a
assert a[a.index("-o") + 1] == "json" and a[a.index("-t") + 1] == "2", a
print("llama_model_loader: loaded", file=sys.stderr)
if n == 13:
    print("error: failed to load model", file=sys.stderr)
    sys.exit(3)
print(json.dumps([{"build_commit": "abc1234", "build_number": 7, "n_prompt": n, "n_gen": 0,
                   "fused_moe": a[a.index("-fmoe") + 1] == "1",
                   "avg_ns": int(n / 200 * 1e9), "avg_ts": 200.0}], indent=2))
"""


def test_bench_engine_ik_flags_follow_the_architecture() -> None:
    """ik_llama.cpp runs with flash attention, fused MoE and run-time repacking on every
    family, and with its MLA mode 3 only on deepseek2."""
    be = _bench_engine()
    assert be.ik_default_args("qwen3moe") == ["-fa", "1", "-fmoe", "1", "-rtr", "1"]
    assert be.ik_default_args("deepseek2") == ["-fa", "1", "-fmoe", "1", "-rtr", "1",
                                               "-mla", "3"]  # fmt: skip


def test_bench_engine_parses_llama_bench_json() -> None:
    """The pp result for the asked prompt length is taken from llama-bench's JSON after its log
    lines: time in seconds, tokens/s and the build; no JSON, or no single pp result for that
    length, is a ValueError saying so."""
    be = _bench_engine()
    rows = [{"n_prompt": 64, "n_gen": 0, "avg_ns": 5e8, "avg_ts": 128.0, "build_commit": "c0"},
            {"n_prompt": 0, "n_gen": 16, "avg_ns": 1e9, "avg_ts": 16.0}]  # fmt: skip
    got = be.parse_llama_bench("main: log line\n" + json.dumps(rows), 64)
    assert got == {"ttft_s": 0.5, "tokens_per_s": 128.0, "build_commit": "c0",
                   "build_number": None}  # fmt: skip
    with pytest.raises(ValueError, match="no JSON"):
        be.parse_llama_bench("error: failed to load model\n", 64)
    with pytest.raises(ValueError, match="0 results for pp32"):
        be.parse_llama_bench(json.dumps(rows), 32)


def test_bench_engine_runs_ik_llama_bench_as_a_baseline(tmp_path: Path) -> None:
    """An ik_llama.cpp run is a child like the others: llama-bench's time and tokens/s, its
    own peak RSS, the flags it ran with and its build; a llama-bench that fails is the run's
    error with the tail of its stderr, not a dead benchmark."""
    be = _bench_engine()
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_IK_BENCH)
    fake.chmod(0o755)
    args = be.ik_default_args("qwen3moe")
    m = be._run(be.ik_cmd(str(fake), tmp_path / "m.gguf", 40, 2, args))
    assert m["ttft_s"] == 0.2 and m["tokens_per_s"] == 200.0
    assert m["ik_args"] == args and m["build_commit"] == "abc1234" and m["build_number"] == 7
    assert m["peak_rss_bytes"] > 0 and m["peak_memory_bytes"] >= m["peak_rss_bytes"]
    bad = be._run(be.ik_cmd(str(fake), tmp_path / "m.gguf", 13, 2, args))
    assert bad["error"] == "exit 3" and "failed to load model" in bad["stderr"]
    assert "ttft_s" not in bad


def test_bench_engine_records_the_ik_build_or_the_given_commit() -> None:
    """The ik build recorded is the one its first successful run reports; a commit given on
    the command line stands in, marked as given, only where llama-bench reports none."""
    be = _bench_engine()
    failed = {"system": "ik_llama.cpp", "error": "exit 1"}
    ok = {"system": "ik_llama.cpp", "ttft_s": 1.0, "build_commit": "unknown", "build_number": 0}
    engine = {"system": "resident", "ttft_s": 0.5}
    assert be.ik_build([engine, failed, ok], "8337e4c") == {
        "build_commit": "8337e4c (given)", "build_number": 0}  # fmt: skip
    assert be.ik_build([ok], None) == {"build_commit": "unknown", "build_number": 0}
    real = {**ok, "build_commit": "abc1234", "build_number": 7}
    assert be.ik_build([real], "8337e4c") == {"build_commit": "abc1234", "build_number": 7}
    assert be.ik_build([failed], None) == {"build_commit": None, "build_number": None}


def test_bench_engine_refuses_ik_on_an_olmoe_file_or_a_missing_executable(
    tmp_path: Path,
) -> None:
    """--ik-llama-bench is refused, in one line and before anything is synthesized, for an
    `olmoe` model (ik_llama.cpp has no such architecture; the message names the qwen3moe way)
    and for a path that is not an executable; --ik-llama-args or --ik-llama-commit alone is
    refused too."""
    script = str(ROOT / "integration" / "bench" / "bench_engine.py")
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_IK_BENCH)
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "ESTREAM_IK_LLAMA_BENCH"}
    cases = [
        (["--ik-llama-bench", str(fake)], "--arch qwen3moe --preset olmoe-1b-7b"),
        (["--arch", "qwen3moe", "--ik-llama-bench", str(tmp_path / "none")],
         "is not an executable file"),
        (["--arch", "qwen3moe", "--ik-llama-args", "-fa 1"], "need --ik-llama-bench"),
        (["--arch", "qwen3moe", "--ik-llama-commit", "8337e4c"], "need --ik-llama-bench"),
    ]  # fmt: skip
    for extra, msg in cases:
        done = subprocess.run(
            [sys.executable, script, "--preset", "tiny-never-made", *extra],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        assert done.returncode == 2 and msg in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    assert not list((ROOT / ".cache" / "models").glob("*tiny-never-made*"))


def test_bench_engine_paced_reader_keeps_to_its_rate_and_stops_on_request(tmp_path: Path) -> None:
    """`--io-tax`'s background reader reads the file round and round, never ahead of its rate
    (at most one 4 MiB request beyond rate x time), and on stop reports what it read; a read
    rate far above the file's size wraps around the file rather than ending."""
    import time

    be = _bench_engine()
    f = tmp_path / "experts.bin"
    f.write_bytes(os.urandom(3 << 20))  # smaller than one request: every read wraps
    rate = 32 * 2**20
    proc = be.start_reader(f, rate)
    time.sleep(0.6)
    done, secs = be.stop_reader(proc)
    assert proc.returncode is not None
    assert 0 < done <= rate * secs + (4 << 20)
    assert done % (3 << 20) == 0  # whole passes over the 3 MiB file
    fast = be.start_reader(f, 1e12)
    time.sleep(0.3)
    done, _ = be.stop_reader(fast)
    assert done > 3 << 20


def test_bench_engine_pair_ratios_take_each_pair_once() -> None:
    """`pair_ratios`: stream ÷ resident of the main free runs, then of each `--pairs` pair by
    its index, at the one length; capped runs, other lengths and a pair with a failed side are
    left out."""
    be = _bench_engine()

    def run(system: str, t: float | None, pair: int = 0, length: int = 1024, cg: bool = False):
        r = {"system": system, "length": length, "cgroup": cg, "pair": pair}
        return {**r, "ttft_s": t} if t else {**r, "error": "failed"}

    rows = [
        run("stream", 2.2), run("resident", 2.0), run("stream", 9.0, cg=True),
        run("stream", 8.0, length=4096), run("resident", 8.0, length=4096),
        run(be.PAIRED["resident"], 2.0, 1), run(be.PAIRED["stream"], 2.0, 1),
        run(be.PAIRED["stream"], 2.1, 2), run(be.PAIRED["resident"], 2.0, 2),
        run(be.PAIRED["resident"], None, 3), run(be.PAIRED["stream"], 2.5, 3),
    ]  # fmt: skip
    assert be.pair_ratios(rows, 1024) == pytest.approx([1.1, 1.0, 1.05])
    assert be.pair_ratios(rows, 4096) == pytest.approx([1.0])
