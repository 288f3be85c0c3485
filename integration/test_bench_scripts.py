"""The benchmark scripts on tiny inputs: those that compare against outside programs run
against a stand-in."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


def test_attention_precision_reports_both_products_per_activation_format(tmp_path: Path) -> None:
    """attention_precision.py: per activation format, the engine's logit error against the
    float64 reference with fp32 and bf16 attention; with f32 activations the fp32 path matches
    the reference and bf16 products are measurably off it; the verdict follows the q8 ratios."""
    out = tmp_path / "p.json"
    script = ROOT / "integration" / "bench" / "attention_precision.py"
    done = subprocess.run(
        [sys.executable, str(script), "--archs", "olmoe", "--tokens", "24", "--prompts", "1",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    rows = {r["act"]: r for r in doc["rows"]}
    assert set(rows) == {"q8", "f32"} and all(r["arch"] == "olmoe" for r in doc["rows"])
    assert rows["f32"]["err_f32_attention"] < 1e-5 < rows["f32"]["err_bf16_attention"]
    for r in doc["rows"]:
        assert r["ratio"] == r["err_bf16_attention"] / r["err_f32_attention"]
    assert doc["bf16_default_ok"] == (rows["q8"]["ratio"] <= doc["limit"])
    bad = subprocess.run(
        [sys.executable, str(script), "--tokens", "0", "--out", str(tmp_path / "x.json")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert bad.returncode == 2 and "--tokens and --prompts must be >= 1" in bad.stderr
    assert not (tmp_path / "x.json").exists()


def _bench_engine():
    sys.path.insert(0, str(ROOT / "integration" / "bench"))
    import bench_engine

    return bench_engine


def test_bench_engine_peaks_are_bench_kernels_measurement() -> None:
    """bench_engine's peaks come from bench_kernels' `measure_peaks` (run in a child on the
    given threads): a GOP/s figure for int8 and fp32 (bf16 where there is such an instruction),
    and the better of two measurements is kept per precision."""
    be = _bench_engine()
    peaks = be.measure_peaks(1)
    assert set(peaks) == {"int8", "fp32", "bf16"}
    assert peaks["int8"] > 0 and peaks["fp32"] > 0
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
