"""Before/after prefill timing of two builds of the engine, alternating fresh processes.

Each side is a ``PYTHONPATH`` (``os.pathsep``-separated source roots that hold a built
``estream_htp`` — its ``_ffi`` extension compiled in place — and ``estream``; the other
packages come from the environment). Runs ``--pairs`` pairs A/B, B/A, A/B, ... of one
``resident`` (or ``--mode``) prefill of ``--tokens`` random tokens each, after a short warm-up
in the same process, and prints for TTFT, prefill CPU time (user + system), whole-process wall
time and peak RSS the medians of each side and the median of the pairwise A/B ratios with their
range, plus the load average: on a shared machine only the ratios mean something. Writes
bench-results/ab_engine.json.

    python integration/bench/ab_engine.py MODEL.estream --a OLD_ROOTS --b NEW_ROOTS \\
        [--a-model OLD.estream] [--tokens 1024] [--pairs 5] [--act q8] [--threads 2]
        [--mode resident]

When the pack format changed between the builds, give the baseline its own pack of the same
GGUF, made by its own estream-layout (``--a-model``; put that estream-layout's source root in
``--a``).

Example roots for a worktree W: ``W/packages/estream-htp/src:W/packages/estream-cli/src``
(build the extension in place first: ``cd W/packages/estream-htp && python setup.py
build_ext --inplace``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CHILD = r"""
import inspect, json, resource, sys
import numpy as np
from estream import Engine  # the public name, which every build exports
spec = json.loads(sys.argv[1])
rng = np.random.default_rng(0)
kw = {"act": spec["act"]}
if "attention" in inspect.signature(Engine).parameters:  # a build before it had none
    kw["attention"] = spec["attention"]
with Engine(spec["model"], mode=spec["mode"], n_threads=spec["threads"], **kw) as e:
    ids = rng.integers(0, e.hp.n_vocab, spec["tokens"])
    e.prefill(ids[:32])
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    res = e.prefill(ids)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({
    "ttft_s": res.metrics["ttft_s"],
    "cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
    "peak_rss_mib": res.metrics["peak_rss_bytes"] / 2**20,
}))
"""


def run_side(roots: str, spec: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=roots)
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(spec)], env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"child failed (PYTHONPATH={roots}):\n{p.stderr}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["process_wall_s"] = wall
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--a", required=True, help="PYTHONPATH of the baseline build")
    ap.add_argument("--b", required=True, help="PYTHONPATH of the new build")
    ap.add_argument(
        "--a-model", help="the baseline's pack of the same GGUF (default: MODEL for both)"
    )
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--act", default="q8", choices=["q8", "f32"])
    ap.add_argument(
        "--attention", default="f32", choices=["f32", "bf16", "bf16-pv"], help="the new build's"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mode", default="resident")
    args = ap.parse_args()
    spec = {
        "model": str(Path(args.model).resolve()),
        "tokens": args.tokens,
        "attention": args.attention,
        "act": args.act,
        "threads": args.threads,
        "mode": args.mode,
    }
    specs = {"a": dict(spec), "b": spec}
    if args.a_model:
        specs["a"]["model"] = str(Path(args.a_model).resolve())
    runs: dict[str, list[dict]] = {"a": [], "b": []}
    load = [os.getloadavg()[0]]
    for i in range(args.pairs):
        order = (("a", args.a), ("b", args.b)) if i % 2 == 0 else (("b", args.b), ("a", args.a))
        for side, roots in order:
            runs[side].append(run_side(roots, specs[side]))
        load.append(os.getloadavg()[0])
    summary = {}
    print(f"{args.pairs} pairs, {args.tokens} tokens, act={args.act}, mode={args.mode}")
    for key in runs["a"][0]:
        a = [r[key] for r in runs["a"]]
        b = [r[key] for r in runs["b"]]
        ratios = [x / y for x, y in zip(a, b, strict=True)]
        summary[key] = {
            "a_median": statistics.median(a),
            "b_median": statistics.median(b),
            "a_over_b_median": statistics.median(ratios),
            "a_over_b_range": [min(ratios), max(ratios)],
        }
        print(
            f"  {key:16s} A {statistics.median(a):10.3f}  B {statistics.median(b):10.3f}  "
            f"A/B median {statistics.median(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f})"
        )
    print(f"  load average (1 min) during the run: {min(load):.1f}..{max(load):.1f}")
    out = ROOT / "bench-results"
    out.mkdir(exist_ok=True)
    doc = {
        "spec": spec,
        "a_model": specs["a"]["model"],
        "summary": summary,
        "runs": runs,
        "load_average": load,
    }
    (out / "ab_engine.json").write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
