"""EStream's prefill tokens/s against a llama.cpp-family `llama-bench` on the same GGUF, in turns.

Any build of `llama-bench` works: mainline llama.cpp, or ik_llama.cpp (the fastest CPU fork
for MoE prefill that we know of: fused MoE kernels, row-interleaved quant layouts with
``-rtr 1``). Nothing is downloaded: build it yourself and pass its path. Both sides get the
weights in memory before the timed pass (llama-bench: its warm-up run over an mmap'd file;
EStream: a warm-up prefill in the same process, ``resident`` mode), so this compares
compute, not loading; ``stream`` mode reads the experts from storage in every pass (O_DIRECT).

Runs ``--rounds`` rounds; in each, every side once, in an order that rotates between rounds,
and prints medians of tokens/s and of the per-round ratios (EStream ÷ llama-bench) with their
range. Writes bench-results/vs_llama_bench.json (``--out``).

    python integration/bench/vs_llama_bench.py MODEL.gguf --llama-bench /path/to/llama-bench \\
        [--pack MODEL.estream] [--tokens 1024] [--rounds 3] [--threads 2] \\
        [--modes resident,stream] [--llama-args "-rtr 1"] [--budget 1GiB]

``stream`` runs under the pack's stored configuration (``estream config``) or the default one; with
``--budget`` it runs under the configurator's (G, Q, B) for that memory budget and this prompt
length, as ``estream prefill --budget`` does (the pack is profiled first if it has no profile).
The configuration each run used is printed and written with its result.

The GGUF must be one that both run: ik_llama.cpp has no ``olmoe`` architecture, so for
OLMoE's shapes synthesize ``estream synth --arch qwen3moe --preset olmoe-1b-7b``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CHILD = r"""
import json, resource, sys
import numpy as np
from estream.engine import Engine
spec = json.loads(sys.argv[1])
rng = np.random.default_rng(0)
budget = spec.get("budget") if spec["mode"] == "stream" else None
with Engine(spec["model"], mode=spec["mode"], n_threads=spec["threads"], budget=budget,
            budget_tokens=spec["tokens"] if budget else None) as e:
    ids = rng.integers(0, e.hp.n_vocab, spec["tokens"])
    e.prefill(ids)  # warm-up: the same length, as llama-bench's warm-up run
    res = e.prefill(ids)
m = res.metrics
cfg = {k: m[k] for k in ("G", "Q", "B", "config_source") if k in m}
print(json.dumps({"ttft_s": m["ttft_s"], "peak_rss_mib": m["peak_rss_bytes"] / 2**20, "config": cfg}))
"""


def run_estream(pack: Path, mode: str, tokens: int, threads: int, budget: int | None) -> dict:
    spec = {
        "model": str(pack),
        "mode": mode,
        "tokens": tokens,
        "threads": threads,
        "budget": budget,
    }
    p = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(spec)], capture_output=True, text=True
    )
    if p.returncode != 0:
        raise SystemExit(f"estream {mode} failed:\n{p.stderr[-4000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["tokens_per_s"] = tokens / out["ttft_s"]
    return out


def run_llama_bench(exe: str, gguf: Path, tokens: int, threads: int, extra: list[str]) -> dict:
    from bench_engine import llama_bench_argv, parse_llama_bench

    cmd = llama_bench_argv(exe, gguf, tokens, threads, extra)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed ({proc.returncode}):\n{stderr[-4000:]}")
    try:
        r = parse_llama_bench(stdout, tokens)
    except ValueError as exc:
        raise SystemExit(f"{shlex.join(cmd)}: {exc}:\n{stdout[-2000:]}") from None
    return {"tokens_per_s": r["tokens_per_s"], "ttft_s": r["ttft_s"],
            "peak_rss_mib": usage.ru_maxrss / 1024}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--llama-bench", default=os.environ.get("ESTREAM_LLAMA_BENCH"),
                    help="path of a llama-bench executable (or $ESTREAM_LLAMA_BENCH)")  # fmt: skip
    ap.add_argument("--pack", type=Path, help="EStream pack of the GGUF (default: GGUF.estream, "
                    "packed first if missing)")  # fmt: skip
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", default="resident,stream")
    ap.add_argument("--llama-args", default="", help="extra llama-bench arguments, e.g. '-rtr 1'")
    ap.add_argument("--budget", help="memory budget for stream, e.g. 1GiB (see above)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "vs_llama_bench.json")
    args = ap.parse_args()
    if not args.llama_bench:
        ap.error("--llama-bench (or $ESTREAM_LLAMA_BENCH) is required: build llama-bench first")
    if not args.gguf.is_file():
        ap.error(f"{args.gguf}: no such file")
    modes = [m for m in args.modes.split(",") if m]
    if any(m not in ("resident", "stream") for m in modes):
        ap.error(f"--modes: resident and/or stream, got {args.modes!r}")
    pack = args.pack or args.gguf.with_suffix(".estream")
    if not (pack / "manifest.json").exists():
        print(f"packing {pack} …", flush=True)
        subprocess.run([sys.executable, "-m", "estream_cli.main", "pack", str(args.gguf), "-o",
                        str(pack)], check=True)  # fmt: skip
    budget = None
    if args.budget:
        from estream.errors import BadRequestError
        from estream.memory import parse_bytes

        try:
            budget = parse_bytes(args.budget)
        except BadRequestError as exc:
            ap.error(f"--budget: {exc}")
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_engine import ensure_profile  # the profile --budget needs, stored once

        ensure_profile(pack)
    extra = shlex.split(args.llama_args)
    label = "llama-bench" + (f" {args.llama_args}" if extra else "")
    sides = [label, *modes]
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    load = [os.getloadavg()[0]]
    for i in range(args.rounds):
        order = sides[i % len(sides) :] + sides[: i % len(sides)]
        for s in order:
            t0 = time.perf_counter()
            if s == label:
                r = run_llama_bench(args.llama_bench, args.gguf, args.tokens, args.threads, extra)
            else:
                r = run_estream(pack, s, args.tokens, args.threads, budget)
            r["process_wall_s"] = time.perf_counter() - t0
            runs[s].append(r)
            cfg = r.get("config") or {}
            how = (
                f"  G={cfg['G']} Q={cfg['Q']} B={cfg['B']} ({cfg['config_source']})" if cfg else ""
            )
            print(f"  round {i + 1} {s:24s} {r['tokens_per_s']:8.1f} tokens/s{how}", flush=True)
        load.append(os.getloadavg()[0])
    print(f"{args.rounds} rounds, {args.tokens} tokens, {args.threads} threads, {args.gguf.name}")
    summary: dict[str, dict] = {}
    base = [r["tokens_per_s"] for r in runs[label]]
    for s in sides:
        tps = [r["tokens_per_s"] for r in runs[s]]
        rss = statistics.median(r["peak_rss_mib"] for r in runs[s])
        summary[s] = {"tokens_per_s_median": statistics.median(tps), "tokens_per_s": tps,
                      "peak_rss_mib_median": rss}  # fmt: skip
        line = f"  {s:24s} {statistics.median(tps):8.1f} tokens/s  peak RSS {rss:8.0f} MiB"
        if s != label:
            ratios = [a / b for a, b in zip(tps, base, strict=True)]
            summary[s]["over_llama_bench_median"] = statistics.median(ratios)
            summary[s]["over_llama_bench_range"] = [min(ratios), max(ratios)]
            line += f"   ÷ llama-bench {statistics.median(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f})"
        print(line)
    print(f"  load average (1 min) during the run: {min(load):.1f}..{max(load):.1f}")
    doc = {
        "gguf": str(args.gguf), "pack": str(pack), "llama_bench": args.llama_bench,
        "llama_args": args.llama_args, "tokens": args.tokens, "threads": args.threads,
        "budget_bytes": budget,
        "summary": summary, "runs": runs, "load_average": load,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    tmp.replace(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
