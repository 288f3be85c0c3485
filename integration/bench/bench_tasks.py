"""Many short requests: requests/s and peak memory, batched passes vs one request at a time.

Synthetic request sets with the length distributions of prefill-only workloads — MASSIVE
intent detection (mean 16 tokens), WinoGrande (23), ToxicChat (66), HellaSwag (80), ARC-C (368);
lengths drawn from a gamma distribution (shape 4) around the mean, random token ids — are run
on the synthetic `olmoe-1b-7b` preset (OLMoE-1B-7B's shapes, ≈ 4 GB; ``--preset`` to change) by

* ``stream-batched``: the engine streaming under the configurator's choice for ``--budget``,
  requests packed into passes by `Engine.prefill_many` (default ``--batch-tokens``),
* ``stream``: the same engine, one `prefill` per request,
* ``resident``: all experts in memory, batched the same way,
* ``llama.cpp``: llama-cpp-python, one request after another (KV cache cleared between them),
  when its wheel is available (else the table says so and the bench goes on),

each in a fresh process with the model's files evicted from the page cache first (per-file
``posix_fadvise``: the machine's other caches are left alone). Requests/s are given with the
cold start (process start, load, first reads) included and excluded. Prints a table and writes
bench-results/bench_tasks.json.

    nox -s bench_tasks -- [--preset olmoe-1b-7b] [--requests 256] [--sets massive,arc-c]
                          [--budget 1.5GiB] [--threads 2] [--no-llama] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import bench_engine  # noqa: E402
from bench_engine import _run, prepare  # noqa: E402

from estream.memory import drop_file_cache, format_bytes, parse_bytes  # noqa: E402

#: Mean request length (tokens) of each set, after the datasets' published statistics.
SETS = {"massive": 16, "winogrande": 23, "toxicchat": 66, "hellaswag": 80, "arc-c": 368}
SYSTEMS = ("stream-batched", "stream", "resident", "llama.cpp")

# Both children: measure themselves, read the spec and the request set, start the clock.
_PRELUDE = (
    r"""
import json, sys, time
import numpy as np
"""
    + bench_engine.CHILD_MEMORY
    + r"""
spec = json.loads(sys.argv[1])
a0 = avail()
t0 = time.perf_counter()
d = np.load(spec["requests"])
reqs = np.split(d["tokens"], np.cumsum(d["lengths"])[:-1])
"""
)

_ENGINE_CHILD = (
    _PRELUDE
    + r"""
import estream
kw = {"budget": spec["budget"]} if spec["budget"] else {}
eng = estream.load(spec["model"], mode=spec["mode"], n_threads=spec["threads"], **kw)
t1 = time.perf_counter()
if spec["batched"]:
    out = list(eng.prefill_many(reqs, batch_tokens=spec["batch_tokens"]))
    passes = len({r.metrics["pass"]["pass_id"] for r in out})
    batch_tokens = spec["batch_tokens"] or eng.default_batch_tokens()
else:
    out = [eng.prefill(r) for r in reqs]
    passes, batch_tokens = len(out), None
t2 = time.perf_counter()
assert len(out) == len(reqs)
print(json.dumps({"load_s": t1 - t0, "run_s": t2 - t1, "passes": passes,
                  "batch_tokens": batch_tokens, "peak_rss_bytes": status("VmHWM"),
                  "mem_available_drop_bytes": max(0, a0 - avail())}))
"""
)

_LLAMA_CHILD = (
    _PRELUDE
    + r"""
import llama_cpp
longest = int(d["lengths"].max())
llm = llama_cpp.Llama(model_path=spec["model"], n_ctx=longest + 8, n_batch=min(longest, 2048),
                      n_ubatch=512, n_threads=spec["threads"], n_threads_batch=spec["threads"],
                      logits_all=False, verbose=False, use_mmap=True, seed=0)
t1 = time.perf_counter()
for r in reqs:
    llm.reset()
    llm.eval([int(t) for t in r])
t2 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "run_s": t2 - t1, "passes": len(reqs),
                  "peak_rss_bytes": status("VmHWM"),
                  "mem_available_drop_bytes": max(0, a0 - avail())}))
"""
)


def request_set(name: str, n: int, n_vocab: int, n_ctx: int, seed: int = 0) -> list[np.ndarray]:
    """``n`` requests whose lengths follow a gamma distribution (shape 4) around the set's
    mean, at least 4 tokens, at most the context."""
    rng = np.random.default_rng(seed + sum(map(ord, name)))
    mean = SETS[name]
    lens = np.clip(np.rint(rng.gamma(4.0, mean / 4.0, size=n)), 4, n_ctx).astype(int)
    return [rng.integers(0, n_vocab, size=int(k)) for k in lens]


def _llama_available() -> str | None:
    """None if llama-cpp-python imports (installing the cached wheel if there is one), else
    why not."""
    from llamacpp import WHEEL_DIR, LlamaCppError, _cached_wheel, _importable, ensure_llama_cpp

    if _importable(sys.executable):
        return None
    if _cached_wheel() is None:
        return f"no llama-cpp-python wheel in {WHEEL_DIR} (build not finished)"
    try:
        ensure_llama_cpp()
    except (LlamaCppError, subprocess.CalledProcessError) as exc:
        return f"llama-cpp-python not installable: {exc}"
    return None


def run_system(
    system: str,
    reqs_file: Path,
    *,
    src: Path,
    dst: Path,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One fresh process answering every request of the set, model files evicted first."""
    for p in (src, dst / "experts.bin", dst / "dense.bin"):
        drop_file_cache(p)
    if system == "llama.cpp":
        spec = {"model": str(src), "requests": str(reqs_file), "threads": args.threads}
        cmd = [sys.executable, "-c", _LLAMA_CHILD, json.dumps(spec)]
    else:
        spec = {
            "model": str(dst),
            "requests": str(reqs_file),
            "threads": args.threads,
            "mode": "resident" if system == "resident" else "stream",
            "budget": None if system == "resident" else args.budget,
            "batched": system != "stream",
            "batch_tokens": args.batch_tokens,
        }
        cmd = [sys.executable, "-c", _ENGINE_CHILD, json.dumps(spec)]
    try:
        m = _run(cmd, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        m = {"error": f"did not finish in {args.timeout:.0f} s"}
    m["system"] = system
    return m


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def table(doc: dict[str, Any]) -> str:
    rows = [
        "| set (mean) | system | req/s cold | req/s warm | passes | peak memory | load avg |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for s in doc["sets"]:
        for m in s["runs"]:
            if "error" in m:
                rows.append(f"| {s['name']} ({s['mean_tokens']:.0f}) | {m['system']} | "
                            f"{m['error']} | | | | {m.get('load', '')} |")  # fmt: skip
                continue
            n = s["requests"]
            cold, warm = n / m["wall_s"], n / m["run_s"]
            rows.append(
                f"| {s['name']} ({s['mean_tokens']:.0f}) | {m['system']} | {cold:.2f} | "
                f"{warm:.2f} | {m['passes']} | {format_bytes(m['peak_memory_bytes'])} "
                f"({format_bytes(m['peak_rss_bytes'])}) | "
                f"{m['load']} |"
            )
        r = s.get("ratios", {})
        if r:
            rows.append(
                f"| {s['name']} | batched ÷ | "
                + " | ".join(f"{k} {v:.2f}x" for k, v in r.items())
                + " | | | |"
            )
    return "\n".join(rows)


def _save(out: Path, doc: dict[str, Any]) -> None:
    out.parent.mkdir(exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="olmoe-1b-7b")
    ap.add_argument("--arch", default="olmoe")
    ap.add_argument("--requests", type=int, default=256, help="requests per set (default 256)")
    ap.add_argument("--sets", default=",".join(SETS), help=f"some of {','.join(SETS)}")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"some of {','.join(SYSTEMS)}")
    ap.add_argument("--budget", default="1.5GiB", help="memory budget of the stream runs")
    ap.add_argument("--batch-tokens", type=int, default=None, help="default: the engine's")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=7200)
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="where to synthesize the model (default: a private temporary directory, deleted "
        "at the end unless --keep; the shared benchmark cache is not touched)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the synthesized model")
    ap.add_argument("--out", type=Path, default=None, help="default bench-results/bench_tasks.json")
    args = ap.parse_args()
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in sets:
        if s not in SETS:
            ap.error(f"unknown set {s!r} (known: {', '.join(SETS)})")
    for s in systems:
        if s not in SYSTEMS:
            ap.error(f"unknown system {s!r} (known: {', '.join(SYSTEMS)})")
    if args.requests < 1:
        ap.error("--requests must be at least 1")
    budget = parse_bytes(args.budget)
    out = args.out or ROOT / "bench-results" / "bench_tasks.json"
    cache = args.cache or Path(tempfile.mkdtemp(prefix="estream-bench-tasks-"))
    bench_engine.CACHE = cache
    llama_note = "skipped (--no-llama)" if args.no_llama else _llama_available()
    if "llama.cpp" in systems and llama_note is not None:
        print(f"llama.cpp: {llama_note}; continuing without it", flush=True)
        systems.remove("llama.cpp")
    work = Path(tempfile.mkdtemp(prefix="estream-bench-tasks-reqs-"))
    doc: dict[str, Any] = {
        "preset": args.preset,
        "arch": args.arch,
        "budget_bytes": budget,
        "threads": args.threads,
        "cold": "per-file posix_fadvise(DONTNEED) of the model files before every run",
        "llama_cpp": llama_note or "llama-cpp-python, one request after another",
        "sets": [],
    }
    try:
        src, dst = prepare(args.preset, budget, arch=args.arch)
        from estream.packed import PackedModel

        hp = PackedModel(dst).hparams
        for name in sets:
            reqs = request_set(name, args.requests, hp.n_vocab, hp.n_ctx)
            lens = np.array([len(r) for r in reqs])
            f = work / f"{name}.npz"
            np.savez(f, tokens=np.concatenate(reqs).astype(np.int32), lengths=lens)
            entry: dict[str, Any] = {
                "name": name,
                "requests": len(reqs),
                "mean_tokens": float(lens.mean()),
                "runs": [],
            }
            print(
                f"{name}: {len(reqs)} requests, {lens.mean():.1f} tokens on average "
                f"({lens.min()}..{lens.max()})",
                flush=True,
            )
            for system in systems:
                load = _load()
                m = run_system(system, f, src=src, dst=dst, args=args)
                m["load"] = load
                entry["runs"].append(m)
                if "error" in m:
                    print(f"  {system:<15s} {m['error']}", flush=True)
                else:
                    print(
                        f"  {system:<15s} {len(reqs) / m['wall_s']:8.2f} req/s cold "
                        f"{len(reqs) / m['run_s']:8.2f} req/s warm  {m['passes']:4d} passes  "
                        f"peak {format_bytes(m['peak_memory_bytes'])} "
                        f"(RSS {format_bytes(m['peak_rss_bytes'])})  (load avg {load})",
                        flush=True,
                    )
            ok = {m["system"]: m for m in entry["runs"] if "error" not in m}
            if "stream-batched" in ok:
                b = ok["stream-batched"]["run_s"]
                entry["ratios"] = {
                    f"{k} (warm)": ok[k]["run_s"] / b for k in ("stream", "llama.cpp") if k in ok
                }
            doc["sets"].append(entry)
            _save(out, doc)  # after every set: a long run interrupted keeps what it measured
        print()
        print(table(doc))
        print(f"\nwritten to {out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if args.cache is None and not args.keep:
            shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    rc = main()
    print(f"bench_tasks: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    sys.exit(rc)
