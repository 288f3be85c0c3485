"""Models larger than memory: Qwen3-30B-A3B- and Mixtral-8x7B-shaped synthetic models, streamed.

For each preset, one after the other (the files of one are deleted before the next is made):

1. `estream synth` and `estream pack` in child processes, timed, with their peak RSS;
2. `estream profile`, then the configurator's choice under each budget (2 GiB, 4 GiB);
3. engine `stream` under the preset's run budget (Qwen3-30B-A3B: 2 GiB, Mixtral-8x7B: 4 GiB)
   at 256/1K/4K tokens: TTFT, tokens/s, peak memory, bytes read, I/O–compute overlap;
4. llama.cpp CPU (llama-cpp-python) on the same GGUF and tokens, with a time limit and its
   private memory capped at the machine's RAM less a reserve (`--llama-reserve`, RLIMIT_DATA:
   the read-only mmap of the model is not counted), so that on a shared machine a model that
   does not fit fails its own allocation rather than waking the system-wide OOM killer; a run
   that does not finish, or fails, is reported as such;
5. a small sweep of (G, Q, B) around the configurator's choice under the run budget, at one
   prompt length, in `--sweep-rounds` interleaved rounds (each round visits every point once,
   starting one point later than the round before): the configurator's regret is its point's
   median TTFT against the best point's median.

Cold page cache before every run, 2 threads, one process per run (machinery shared with
`bench_engine.py`). Prints tables and writes bench-results/bench_scale.{json,md}.

    nox -s bench_scale -- [--presets qwen3-30b-a3b,mixtral-8x7b] [--lengths 256,1024,4096]
                          [--timeout 900] [--llama-timeout 900] [--sweep-length 1024]
                          [--sweep-rounds 3] [--no-runs] [--no-llama] [--keep]

Without llama.cpp (`--no-llama`) the GGUF is deleted as soon as it is packed (unless `--keep`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # parity imports integration/reference.py

from bench_engine import (  # noqa: E402
    CACHE,
    RESULTS,
    configure_and_store,
    model_paths,
    run_system,
)

from estream.memory import format_bytes, parse_bytes  # noqa: E402

# preset -> (architecture, budget the streamed runs use: the aim for that model)
PRESETS: dict[str, tuple[str, str]] = {
    "qwen3-30b-a3b": ("qwen3moe", "2GiB"),
    "mixtral-8x7b": ("mixtral", "4GiB"),
}
# The paper's Table 3 (Snapdragon 8 Elite Gen 5 NPU, UFS 4.1), for the README's comparison.
PAPER_TABLE3 = {
    "qwen3-30b-a3b": "212–599 tok/s, 1.46–1.87 GiB (1–4K tokens in 4.8–6.8 s)",
    "mixtral-8x7b": "145–302 tok/s, 2.8–4.1 GiB",
}


def shape_check(preset: str, threads: int, n_layers: int = 2, n_tokens: int = 64) -> dict[str, Any]:
    """llama.cpp loads the preset's shapes and computes what the engine computes: the preset cut
    to `n_layers` layers (every tensor shape, key and the tokenizer as in the full model),
    all-position logits of llama.cpp vs the engine (`resident`, default int8 activations)."""
    import tempfile

    import numpy as np
    from llamacpp import llama_logits
    from parity import compare, engine_logits

    from estream_layout import synth_model

    arch = PRESETS[preset][0]
    out: dict[str, Any] = {"n_layers": n_layers, "tokens": n_tokens}
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        gguf = synth_model(
            arch, preset, Path(tmp) / f"{preset}-{n_layers}l.gguf", n_layers=n_layers
        )
        tokens = np.random.default_rng(1).integers(0, 1000, size=n_tokens).tolist()
        try:
            lcpp = llama_logits(gguf, tokens, n_threads=threads)
        except Exception as exc:
            out["llama_error"] = str(exc)
            return out
        out["llama_finite"] = bool(np.isfinite(lcpp).all())
        out["llama_logit_std"] = float(lcpp.std())
        eng, why = engine_logits(gguf, Path(tmp), tokens, "resident")
        if eng is None:
            out["engine_error"] = why
        else:
            out["engine_vs_llamacpp"] = compare(eng, lcpp)
    return out


def run_measured(cmd: list[str]) -> dict[str, Any]:
    """Run a child to completion (its stderr, e.g. a progress line, goes to ours); wall time
    and the child's own peak RSS (`wait4` rusage, not the whole process tree's maximum)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    res = {"wall_s": wall, "peak_rss_bytes": usage.ru_maxrss * 1024, "exit": proc.returncode}
    if proc.returncode != 0:
        res["error"] = f"exit {proc.returncode}: {out.strip()[-400:]}"
    return res


def estream(*args: str) -> list[str]:
    return [sys.executable, "-m", "estream_cli.main", *args]


def sweep_points(choice: Any, profile: Any) -> list[tuple[int, int, int]]:
    """The configurator's (G, Q, B) and its neighbours that fit the same budget: one bank fewer
    and more, half and twice the queue depth, and the adjacent group sizes at the bank count
    the model predicts best for them."""
    G, Q, B = int(choice.G), int(choice.Q), int(choice.B)
    feasible = {(r.g, r.b): r for r in choice.table if r.feasible}
    pts = [(G, Q, B)]
    for b in (B - 1, B + 1):
        if (G, b) in feasible and b >= Q:
            pts.append((G, Q, b))
    for q in (Q // 2, 2 * Q):
        if 1 <= q <= B and q != Q:
            pts.append((G, q, B))
    groups = sorted(profile.groups)
    i = groups.index(G)
    for g in groups[max(0, i - 1) : i] + groups[i + 1 : i + 2]:
        rows = [r for (g2, _), r in feasible.items() if g2 == g]
        if rows:
            best = min(rows, key=lambda r: (r.predicted_s, r.b))
            pts.append((g, Q, best.b))
    return list(dict.fromkeys(pts))


def summarize_point(s: dict[str, Any]) -> None:
    """A sweep point's figures: the median-TTFT trial's metrics, plus every trial's TTFT."""
    ok = sorted((t for t in s["trials"] if "ttft_s" in t), key=lambda t: t["ttft_s"])
    for k in [k for k in s if k not in ("G", "Q", "B", "choice", "trials")]:
        del s[k]
    if not ok:
        s["error"] = s["trials"][-1].get("error", "failed")
        return
    med = ok[(len(ok) - 1) // 2]  # the lower median: a trial that ran, not an average
    s.update({k: v for k, v in med.items() if k not in s})
    s["ttft_trials_s"] = [t["ttft_s"] for t in s["trials"] if "ttft_s" in t]


def sweep_regret(sweep: list[dict[str, Any]]) -> dict[str, Any]:
    """The configurator's regret: its point's median TTFT over the best point's, minus 1."""
    done = [s for s in sweep if "ttft_s" in s]
    chosen = [s for s in done if s["choice"]]
    if not done or not chosen:
        return {}
    best = min(done, key=lambda s: s["ttft_s"])
    return {
        "sweep_best": {k: best[k] for k in ("G", "Q", "B", "ttft_s")},
        "choice_regret": chosen[0]["ttft_s"] / best["ttft_s"] - 1.0,
    }


def profile_is_stale(model: Any) -> bool:
    """Whether the pack's stored profile was measured with something else than this machine,
    these kernels and the engine's default threads (`estream.config.profile_staleness`)."""
    from estream.config import profile_staleness

    return bool(profile_staleness(model))


def bench_preset(preset: str, args: argparse.Namespace) -> dict[str, Any]:
    from estream.config import configure_for_budget, stored_profile
    from estream.errors import BudgetTooSmallError
    from estream.packed import PackedModel

    arch, run_budget_s = PRESETS[preset]
    run_budget = parse_bytes(run_budget_s)
    src, dst = model_paths(arch, preset)
    CACHE.mkdir(parents=True, exist_ok=True)
    rec: dict[str, Any] = {"preset": preset, "arch": arch, "run_budget_bytes": run_budget}
    free = shutil.disk_usage(CACHE).free
    print(f"\n=== {preset} ({arch}); {format_bytes(free)} free on disk", flush=True)
    packed = (dst / "manifest.json").exists()
    need_src = not packed or args.llama  # the pack is made from it; llama.cpp reads it
    if need_src and not src.exists():
        print(f"synthesizing {src} …", flush=True)
        rec["synth"] = run_measured(
            estream("synth", "--arch", arch, "--preset", preset, "-o", str(src))
        )
        if "error" in rec["synth"]:
            return rec
        rec["synth"]["bytes"] = src.stat().st_size
        print(f"  {_step(rec['synth'])}", flush=True)
    if src.exists():
        rec["gguf_bytes"] = src.stat().st_size
    if not packed:
        print(f"packing {dst} …", flush=True)
        rec["pack"] = run_measured(estream("pack", str(src), "-o", str(dst), "--force"))
        if "error" in rec["pack"]:
            return rec
        rec["pack"]["bytes"] = sum(f.stat().st_size for f in dst.iterdir())
        print(f"  {_step(rec['pack'])}", flush=True)
    if not args.llama and not args.keep and src.exists():  # only llama.cpp reads the GGUF
        src.unlink()
        print(f"removed {src} (not needed without llama.cpp)", flush=True)
    model = PackedModel(dst)
    rec["experts_bytes"] = model.experts_path.stat().st_size
    rec["dense_bytes"] = int(model.dense_bytes)
    # profiled once, again when the stored profile is stale (other kernels, CPU, threads)
    if not model.manifest.get("profile") or profile_is_stale(model):
        print("profiling (one calibration request per candidate g) …", flush=True)
        t0 = time.perf_counter()
        done = subprocess.run(estream("profile", "--if-stale", str(dst)))
        rec["profile_s"] = time.perf_counter() - t0
        if done.returncode != 0:
            rec["error"] = f"estream profile exited {done.returncode}"
            return rec
    model = PackedModel(dst)
    profile = stored_profile(model)
    rec["configs"] = {}
    for b_s in args.budgets.split(","):
        b = parse_bytes(b_s)
        try:
            c = configure_for_budget(model, b)
        except BudgetTooSmallError as exc:
            rec["configs"][b_s] = {"error": str(exc), "minimum_bytes": exc.minimum_bytes}
            print(f"config for {b_s}: {exc}", flush=True)
            continue
        rec["configs"][b_s] = {
            "G": c.G, "Q": c.Q, "B": c.B,
            "predicted_s": c.predicted_s, "memory_bytes": c.memory_bytes,
        }  # fmt: skip
        print(
            f"config for {b_s}: G={c.G} Q={c.Q} B={c.B} (predicted {format_bytes(c.memory_bytes)})",
            flush=True,
        )
    choice = configure_and_store(dst, run_budget)
    if args.shape_check and _llama(args):
        try:
            rec["shape_check"] = shape_check(preset, args.threads)
        except Exception as exc:  # a failed check is a result, not the end of the benchmark
            rec["shape_check"] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"shape check (2 layers, llama.cpp vs engine): {rec['shape_check']}", flush=True)
    n_vocab = model.hparams.n_vocab
    common = {"src": src, "dst": dst, "n_vocab": n_vocab, "threads": args.threads}
    lengths = [int(x) for x in args.lengths.split(",")]
    runs: list[dict[str, Any]] = []
    systems = [("stream", args.timeout)] + (
        [("llama.cpp", args.llama_timeout)] if args.llama else []
    )
    for system, timeout in systems if args.runs else ():
        gave_up = None
        for T in lengths:
            if gave_up is not None:
                runs.append({"system": system, "length": T, "error": f"not run ({gave_up})"})
                continue
            limit = _llama_data_limit(args) if system == "llama.cpp" else None
            m = run_system(system, T, timeout=timeout, data_limit=limit, **common)
            if limit:
                m["data_limit_bytes"] = limit
                if "error" in m and "timeout_s" not in m:
                    m["error"] += f" (private memory capped at {format_bytes(limit)})"
            runs.append(m)
            if "error" in m:
                gave_up = f"{m['length']} tokens: {m['error']}"
        _save(args, preset, {**rec, "runs": runs})
    rec["runs"] = runs
    # sweep around the configurator's choice, at one length: `--sweep-rounds` rounds, each
    # visiting every point once in a rotated order (so a slow spell of a shared machine does not
    # land on one point), each point's median TTFT compared
    T = args.sweep_length
    sweep: list[dict[str, Any]] = []
    if T and args.sweep:
        points = sweep_points(choice, profile)
        print(
            f"sweep around G={choice.G} Q={choice.Q} B={choice.B} at {T} tokens, "
            f"{args.sweep_rounds} round(s) of {len(points)} points:",
            flush=True,
        )
        sweep = [
            {"G": g, "Q": q, "B": b, "choice": (g, q, b) == (choice.G, choice.Q, choice.B),
             "trials": []}
            for g, q, b in points
        ]  # fmt: skip
        for rnd in range(args.sweep_rounds):
            for j in range(len(sweep)):
                s = sweep[(j + rnd) % len(sweep)]
                m = run_system(
                    "stream", T, timeout=args.timeout, engine_args=("-G", str(s["G"]), "-Q",
                    str(s["Q"]), "-B", str(s["B"])), label=f" G{s['G']}Q{s['Q']}B{s['B']}",
                    **common,
                )  # fmt: skip
                s["trials"].append(m)
                summarize_point(s)
                _save(args, preset, {**rec, "sweep": sweep})
        rec.update(sweep_regret(sweep))
        if "choice_regret" in rec:
            print(
                f"  configurator regret vs sweep best (medians): {100 * rec['choice_regret']:.1f}%"
            )
    rec["sweep"] = sweep
    return rec


def _llama_data_limit(args: argparse.Namespace) -> int | None:
    """Private-memory cap for llama.cpp: the machine's RAM less a reserve for everything else
    running on it. llama.cpp's CPU backend copies (repacks) Q4_0 weights into private memory; a
    model bigger than the machine then fails that allocation instead of making the kernel's
    OOM killer pick among everyone's processes."""
    if args.llama_reserve is None:
        return None
    with open("/proc/meminfo") as f:
        total = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemTotal:"))
    return max(1 << 30, total - parse_bytes(args.llama_reserve))


def _llama(args: argparse.Namespace) -> bool:
    """llama-cpp-python importable (built once, cached); asked only when first needed, after
    the long synth/pack/profile steps."""
    if not args.llama or "llama_cpp_python" in _DOC:
        return bool(args.llama)
    try:
        from llamacpp import ensure_llama_cpp, llama_cpp_version

        ensure_llama_cpp()
        _DOC["llama_cpp_python"] = llama_cpp_version()
    except Exception as exc:  # report, do not hide: the table says why the column is empty
        print(f"llama.cpp unavailable: {exc}", flush=True)
        _DOC["llama_error"] = str(exc)
        args.llama = False
    return bool(args.llama)


def _step(r: dict[str, Any]) -> str:
    rate = r.get("bytes", 0) / r["wall_s"] / 1e6 if r.get("wall_s") else 0.0
    return (
        f"{format_bytes(r.get('bytes', 0))} in {r['wall_s']:.0f} s ({rate:.0f} MB/s), "
        f"peak RSS {format_bytes(r['peak_rss_bytes'])}"
    )


_DOC: dict[str, Any] = {}


def _save(args: argparse.Namespace, preset: str, rec: dict[str, Any]) -> None:
    """Write what is known so far: a long benchmark cut short still leaves its figures."""
    _DOC.setdefault("presets", {})[preset] = rec
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(_DOC, indent=1, default=str))
    tmp.replace(args.out)  # a reader never sees half a file


def table(doc: dict[str, Any]) -> str:
    """Markdown tables of the results."""
    lines = [
        "| model | prompt | stream TTFT | tok/s | peak (RSS) | read | overlap | llama.cpp TTFT | "
        "llama.cpp peak (RSS) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for preset, rec in doc.get("presets", {}).items():
        runs = rec.get("runs", [])
        for T in sorted({r["length"] for r in runs}):
            s = next((r for r in runs if r["system"] == "stream" and r["length"] == T), {})
            ll = next((r for r in runs if r["system"] == "llama.cpp" and r["length"] == T), {})
            ov = f"{s['io_compute_overlap']:.2f}" if "io_compute_overlap" in s else "-"
            read = format_bytes(s["bytes_read"]) if "bytes_read" in s else "-"
            lines.append(
                f"| {preset} | {T} | {_ttft(s)} | {_tps(s, T)} | {_peak(s)} | {read} | {ov} | "
                f"{_ttft(ll)} | {_peak(ll)} |"
            )
    lines += ["", "| model | budget | G | Q | B | predicted memory |", "|---|---|---|---|---|---|"]
    for preset, rec in doc.get("presets", {}).items():
        for b, c in rec.get("configs", {}).items():
            if "error" in c:
                lines.append(
                    f"| {preset} | {b} | – | – | – | below minimum "
                    f"{format_bytes(c['minimum_bytes'])} |"
                )
            else:
                lines.append(
                    f"| {preset} | {b} | {c['G']} | {c['Q']} | {c['B']} | "
                    f"{format_bytes(c['memory_bytes'])} |"
                )
    lines += [
        "",
        "| model | G | Q | B | median TTFT [trials] | peak (RSS) | |",
        "|---|---|---|---|---|---|---|",
    ]
    for preset, rec in doc.get("presets", {}).items():
        for s in rec.get("sweep", []):
            mark = "configurator" if s.get("choice") else ""
            if rec.get("sweep_best") and all(rec["sweep_best"][k] == s[k] for k in "GQB"):
                mark += " best" if mark else "best"
            trials = ", ".join(f"{t:.2f}" for t in s.get("ttft_trials_s", []))
            lines.append(
                f"| {preset} | {s['G']} | {s['Q']} | {s['B']} | {_ttft(s)} [{trials}] | "
                f"{_peak(s)} | {mark} |"
            )
        if "choice_regret" in rec:
            lines.append(f"| {preset} | regret | | | {100 * rec['choice_regret']:.1f}% | | |")
    return "\n".join(lines)


def _ttft(r: dict[str, Any]) -> str:
    return f"{r['ttft_s']:.2f} s" if "ttft_s" in r else r.get("error", "-")


def _tps(r: dict[str, Any], T: int) -> str:
    return f"{T / r['ttft_s']:.1f}" if "ttft_s" in r else "-"


def _peak(r: dict[str, Any]) -> str:
    if "peak_memory_bytes" not in r:
        return "-"
    return f"{format_bytes(r['peak_memory_bytes'])} ({format_bytes(r['peak_rss_bytes'])})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--lengths", default="256,1024,4096")
    ap.add_argument("--budgets", default="2GiB,4GiB", help="budgets the configurator is asked")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900.0, help="limit per engine run (s)")
    ap.add_argument("--llama-timeout", type=float, default=900.0, help="limit per llama.cpp run")
    ap.add_argument("--no-llama", dest="llama", action="store_false")
    ap.add_argument(
        "--llama-reserve",
        default="6GiB",
        help="llama.cpp's private memory is capped at RAM minus this (RLIMIT_DATA); 'none': no cap",
    )
    ap.add_argument("--sweep-length", type=int, default=1024)
    ap.add_argument("--no-sweep", dest="sweep", action="store_false")
    ap.add_argument(
        "--sweep-rounds", type=int, default=3, help="rounds over the sweep points (medians)"
    )
    ap.add_argument(
        "--no-runs", dest="runs", action="store_false",
        help="skip the per-length stream and llama.cpp runs (configurator and sweep only)",
    )  # fmt: skip
    ap.add_argument("--no-shape-check", dest="shape_check", action="store_false")
    ap.add_argument("--keep", action="store_true", help="keep the GGUF and pack afterwards")
    ap.add_argument(
        "--out",
        default="bench_scale.json",
        help="results file (JSON, and a .md beside it): a bare name goes in bench-results/",
    )
    ap.add_argument("--smoke", action="store_true", help="check the script on a small model")
    args = ap.parse_args()
    if args.sweep_rounds < 1:
        ap.error(f"--sweep-rounds must be at least 1, got {args.sweep_rounds}")
    # resolved and checked now, not when the first figures are saved minutes or hours later
    out = Path(args.out)
    if out.parent == Path():
        RESULTS.mkdir(exist_ok=True)
        out = RESULTS / out
    if not out.parent.is_dir():
        ap.error(f"--out: directory {out.parent} does not exist")
    if out.suffix != ".json":
        ap.error(f"--out: {out} should end in .json (a .md table is written beside it)")
    args.out = out
    if str(args.llama_reserve).lower() == "none":
        args.llama_reserve = None
    if args.smoke:
        PRESETS["small"] = ("qwen3moe", "2GiB")
        args.presets = "small"
    unknown = set(args.presets.split(",")) - set(PRESETS)
    if unknown:
        ap.error(f"unknown preset(s) {sorted(unknown)}; choose from {sorted(PRESETS)}")
    _DOC.update({"threads": args.threads, "timeout_s": args.timeout,
                 "llama_timeout_s": args.llama_timeout, "paper_table3": PAPER_TABLE3})  # fmt: skip
    for preset in args.presets.split(","):
        src, dst = model_paths(PRESETS[preset][0], preset)
        rec = bench_preset(preset, args)  # on a crash the files stay, for a rerun to reuse
        if not args.keep:  # the next preset needs the disk space
            shutil.rmtree(dst, ignore_errors=True)
            src.unlink(missing_ok=True)
        _save(args, preset, rec)
    md = table(_DOC)
    print("\n" + md)
    args.out.with_suffix(".md").write_text(md + "\n")
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
