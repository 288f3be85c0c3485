"""Corpus classify on Ray Data: rows/s on 1 and 2 actors against the plain JSON Lines command.

A MASSIVE-shaped set — short utterances (a handful of words, a gamma-distributed length around
the intent-detection mean) and 60 intent labels (scenario_action names, several tokens each,
so every row scores 60 branches of one shared-prefix pass) — is classified on the synthetic
``olmoe-1b-7b`` preset (``--preset`` to change), streamed under the configurator's choice for
``--budget``, by

* ``plain``: ``estream classify --input rows.jsonl --output out.jsonl --threads 1``,
* ``ray-1``: the same with ``--ray --actors 1`` (a local Ray; each actor one thread and the
  same budget),
* ``ray-2``: ``--ray --actors 2``,

each a fresh process, the pack's files evicted from the page cache first (per-file
``posix_fadvise``). Rows/s are given with everything included (process start, Ray start, model
load: ``wall``) and for the run alone (the command's own timing, after load or Ray start:
``run``; a Ray run's includes its actors' pack verification and model load, which the plain
run's does not). The overhead of Ray at one actor is ``ray-1``'s time over ``plain``'s, minus
one, for both; each Ray run's answers are compared with the plain run's (less the metrics),
and its ``phases`` line (where its time went: Ray start, each actor's start, load, pack check
and blocks) is kept with its run. Blocks are the command's default (the rows shared between
the actors: one actor answers them in the plain command's passes) unless ``--block-rows``.
Writes bench-results/bench_ray.json.

    nox -s bench_ray -- [--preset olmoe-1b-7b] [--rows 128] [--budget 1.5GiB] [--block-rows N]
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
from bench_engine import prepare  # noqa: E402

from estream.memory import drop_file_cache, parse_bytes  # noqa: E402

SCENARIOS = (
    "alarm", "audio", "calendar", "cooking", "datetime", "email", "general", "iot", "lists",
    "music", "news", "play", "qa", "recommendation", "social", "takeaway", "transport",
    "weather",
)  # fmt: skip
ACTIONS = ("query", "set", "remove", "play", "create", "order", "factoid", "volume_mute")
WORDS = [
    "wake",
    "me",
    "up",
    "at",
    "seven",
    "tomorrow",
    "please",
    "set",
    "an",
    "alarm",
    "for",
    "the",
    "meeting",
    "what",
    "is",
    "the",
    "weather",
    "like",
    "in",
    "paris",
    "turn",
    "off",
    "the",
    "kitchen",
    "lights",
    "play",
    "some",
    "jazz",
    "music",
    "order",
    "a",
    "pizza",
    "from",
    "the",
    "place",
    "down",
    "the",
    "road",
    "remind",
    "me",
    "to",
    "call",
    "mom",
    "add",
    "milk",
    "to",
    "my",
    "shopping",
    "list",
    "how",
    "long",
    "is",
    "the",
    "train",
    "to",
    "boston",
    "read",
    "me",
    "the",
    "news",
    "about",
    "football",
    "send",
    "an",
    "email",
    "to",
    "john",
]
SYSTEMS = ("plain", "ray-1", "ray-2")
#: Mean words of an utterance (MASSIVE's mean is about 16 tokens).
MEAN_WORDS = 8


def intents(n: int = 60) -> list[str]:
    """``n`` distinct scenario_action labels."""
    out = [f"{s}_{a}" for a in ACTIONS for s in SCENARIOS]
    return out[:n]


def utterances(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` requests ``{"id", "prompt"}``: word counts from a gamma (shape 4) around
    `MEAN_WORDS`, at least 2."""
    rng = np.random.default_rng(seed)
    lens = np.clip(np.rint(rng.gamma(4.0, MEAN_WORDS / 4.0, size=n)), 2, 40).astype(int)
    return [
        {"id": i, "prompt": " ".join(rng.choice(WORDS, size=int(k))) + " intent:"}
        for i, k in enumerate(lens)
    ]


def _evict(pack: Path) -> None:
    for f in pack.rglob("*"):
        if f.is_file():
            drop_file_cache(f)


_TIMING = re.compile(r"(\d+) requests? (?:in|on) .*?, ([0-9.]+) s \(")


def run_system(system: str, pack: Path, rows: Path, out: Path, args: Any) -> dict[str, Any]:
    """One run in a fresh process: wall time, the command's own run time, its exit code."""
    labels = ",".join(intents(args.labels))
    cmd = [
        sys.executable, "-m", "estream_cli.main", "classify", str(pack), "--input", str(rows),
        "--labels", labels, "--output", str(out), "--threads", "1",
    ]  # fmt: skip
    if args.budget:
        cmd += ["--budget", args.budget]
    if args.batch_tokens:
        cmd += ["--batch-tokens", str(args.batch_tokens)]
    if system != "plain":
        cmd += ["--ray", "--actors", system.split("-")[1]]
        if args.block_rows:
            cmd += ["--block-rows", str(args.block_rows)]
    _evict(pack)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"system": system, "error": f"did not finish in {args.timeout:.0f} s", "load": load}
    wall = time.perf_counter() - t0
    m = _TIMING.search(done.stderr)
    if done.returncode != 0 or m is None:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        return {"system": system, "error": f"exit {done.returncode}: {tail[0]}", "load": load}
    out = {"system": system, "wall_s": wall, "run_s": float(m.group(2)), "load": load}
    phases = [s for s in done.stderr.splitlines() if " phases: " in s]
    if phases:  # a Ray run's phases line: where the time went
        out["phases"] = phases[-1].split(" phases: ", 1)[1]
    return out


def _answers(path: Path) -> list[str]:
    lines = [json.loads(s) for s in path.read_text().splitlines()]
    return [json.dumps({k: v for k, v in x.items() if k != "metrics"}) for x in lines]


def table(doc: dict[str, Any]) -> str:
    n = doc["rows"]
    rows = [
        "| system | rows/s (wall) | rows/s (run) | same answers | load avg |",
        "|---|---:|---:|---|---|",
    ]
    for r in doc["runs"]:
        if "error" in r:
            rows.append(f"| {r['system']} | {r['error']} | | | {r['load']} |")
            continue
        rows.append(
            f"| {r['system']} | {n / r['wall_s']:.2f} | {n / r['run_s']:.2f} | "
            f"{r.get('same_answers', '–')} | {r['load']} |"
        )
    if doc.get("overhead_one_actor_run") is not None:
        rows.append(
            f"\nRay at one actor: {100 * doc['overhead_one_actor_run']:+.1f} % run time, "
            f"{100 * doc['overhead_one_actor_wall']:+.1f} % wall time"
        )
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="olmoe-1b-7b")
    ap.add_argument("--arch", default="olmoe")
    ap.add_argument("--rows", type=int, default=128, help="utterances (default 128)")
    ap.add_argument("--labels", type=int, default=60, help="intent labels (default 60)")
    ap.add_argument("--budget", default="1.5GiB", help="memory budget of each process/actor")
    ap.add_argument(
        "--block-rows",
        type=int,
        default=None,
        help="rows per Ray block (default: the command's, the rows shared between the actors)",
    )
    ap.add_argument("--batch-tokens", type=int, default=None, help="default: the engine's")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"some of {','.join(SYSTEMS)}")
    ap.add_argument("--timeout", type=float, default=7200)
    ap.add_argument("--cache", type=Path, default=None, help="where to synthesize the model")
    ap.add_argument("--keep", action="store_true", help="keep the synthesized model")
    ap.add_argument("--out", type=Path, default=None, help="default bench-results/bench_ray.json")
    args = ap.parse_args()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in SYSTEMS:
            ap.error(f"unknown system {s!r} (known: {', '.join(SYSTEMS)})")
    if args.rows < 1 or not 2 <= args.labels <= len(intents(1000)):
        ap.error(f"--rows must be >= 1 and --labels 2..{len(intents(1000))}")
    budget = parse_bytes(args.budget)
    out = args.out or ROOT / "bench-results" / "bench_ray.json"
    cache = args.cache or Path(tempfile.mkdtemp(prefix="estream-bench-ray-"))
    bench_engine.CACHE = cache
    work = Path(tempfile.mkdtemp(prefix="estream-bench-ray-rows-"))
    try:
        _, pack = prepare(args.preset, budget, arch=args.arch)
        rows = work / "rows.jsonl"
        reqs = utterances(args.rows)
        rows.write_text("".join(json.dumps(r) + "\n" for r in reqs))
        doc: dict[str, Any] = {
            "preset": args.preset,
            "arch": args.arch,
            "rows": args.rows,
            "labels": args.labels,
            "mean_words": float(np.mean([len(r["prompt"].split()) for r in reqs])),
            "budget_bytes": budget,
            "threads_per_process": 1,
            "block_rows": args.block_rows,
            "cold": "per-file posix_fadvise(DONTNEED) of the pack before every run",
            "runs": [],
        }
        plain_answers = None
        for system in systems:
            res = work / f"{system}.jsonl"
            r = run_system(system, pack, rows, res, args)
            if "error" not in r:
                answers = _answers(res)
                if system == "plain":
                    plain_answers = answers
                elif plain_answers is not None:
                    r["same_answers"] = answers == plain_answers
                print(
                    f"  {system:<6s} {args.rows / r['wall_s']:8.2f} rows/s wall "
                    f"{args.rows / r['run_s']:8.2f} rows/s run  (load avg {r['load']})",
                    flush=True,
                )
            else:
                print(f"  {system:<6s} {r['error']}", flush=True)
            doc["runs"].append(r)
        ok = {r["system"]: r for r in doc["runs"] if "error" not in r}
        both = {"plain", "ray-1"} <= set(ok)
        for key in ("run_s", "wall_s"):
            over = ok["ray-1"][key] / ok["plain"][key] - 1 if both else None
            doc[f"overhead_one_actor_{key.removesuffix('_s')}"] = over
        out.parent.mkdir(exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(out)
        print()
        print(table(doc))
        print(f"\nwritten to {out}")
        bad = [r["system"] for r in doc["runs"] if r.get("same_answers") is False]
        if bad:
            print(f"bench_ray: {', '.join(bad)} answered differently from plain", file=sys.stderr)
            return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if args.cache is None and not args.keep:
            shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    rc = main()
    print(f"bench_ray: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    sys.exit(rc)
