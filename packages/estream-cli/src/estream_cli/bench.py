"""`estream bench`: TTFT and peak memory over prompt lengths × modes, one fresh process per run.

Each run is a separate `estream prefill --json` process so that peak memory is that run's alone.
`--cold` drops the page cache before each run (as root through /proc/sys/vm/drop_caches,
otherwise `posix_fadvise(DONTNEED)` on the pack's files).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from estream import memory
from estream.errors import BadRequestError, EStreamError

__all__ = ["cpu_steal_s", "drop_page_cache", "parse_steal_ticks", "run_bench", "run_one"]


def parse_steal_ticks(stat: str) -> int | None:
    """The machine's steal ticks (all CPUs) from the text of /proc/stat, or None when the kernel
    does not report them: the eighth field of the ``cpu`` line, time the hypervisor ran something
    else while a virtual CPU of this machine had work."""
    for line in stat.splitlines():
        f = line.split()
        if f and f[0] == "cpu":
            return int(f[8]) if len(f) > 8 else None
    return None


def cpu_steal_s() -> float | None:
    """Seconds of steal so far, summed over this machine's CPUs (None off Linux or when the
    kernel does not count it). On a virtual machine a run's steal is wall-clock time its busy
    threads did not get: take the difference around a run and report it beside its times."""
    try:
        with open("/proc/stat") as f:
            ticks = parse_steal_ticks(f.read())
    except OSError:
        return None
    return None if ticks is None else ticks / os.sysconf("SC_CLK_TCK")


def drop_page_cache(paths: list[Path]) -> str:
    """Drop cached pages; returns how ("drop_caches" or "fadvise")."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for p in paths:
            memory.drop_file_cache(p)
        return "fadvise"


def run_one(
    model: str | Path,
    tokens: np.ndarray,
    mode: str,
    *,
    extra: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "estream_cli.main",
        "prefill",
        str(model),
        "--tokens",
        ",".join(str(int(t)) for t in tokens),
        "--mode",
        mode,
        "--json",
        *(extra or []),
    ]
    steal0 = cpu_steal_s()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    steal1 = cpu_steal_s()
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"]
        why = lines[-1].removeprefix("estream: error: ")
        raise EStreamError(f"the {mode} run of {len(tokens)} tokens failed: {why}")
    m = json.loads(proc.stdout)["metrics"]
    if steal0 is not None and steal1 is not None:
        m["steal_s"] = steal1 - steal0
    return m


def run_bench(args: argparse.Namespace) -> int:
    from estream.engine import MODES
    from estream.packed import PackedModel

    from .options import parse_ints

    lengths = parse_ints(args.lengths, "--lengths", minimum=1)
    modes = [m.strip() for m in args.modes.split(",")]
    for m in modes:
        if m not in MODES:
            raise BadRequestError(
                f"--modes: unknown mode {m!r} (give comma-separated modes among {', '.join(MODES)})"
            )
    if args.budget is not None and "stream" not in modes:
        raise BadRequestError(
            "--budget applies to the stream runs only, and --modes has no stream: drop it "
            "or add stream to --modes"
        )
    if args.budget is not None:
        memory.parse_bytes(args.budget)  # a bad budget is refused before any run
    model = PackedModel(args.model)
    hp = model.hparams
    for T in lengths:  # every length checked before the first run
        if hp.n_ctx < T:
            raise BadRequestError(
                f"--lengths {T} is longer than the model context ({hp.n_ctx} tokens)"
            )
    rng = np.random.default_rng(0)
    files = [model.experts_path, model.path / "dense.bin"]
    rows: list[dict[str, Any]] = []
    for T in lengths:
        tokens = rng.integers(0, hp.n_vocab, size=T)
        for mode in modes:
            extra: list[str] = []
            if mode == "stream" and args.budget:
                extra += ["--budget", args.budget]
            if args.threads:
                extra += ["--threads", str(args.threads)]
            for rep in range(args.repeat):
                how = drop_page_cache(files) if args.cold else "warm"
                m = run_one(args.model, tokens, mode, extra=extra)
                m.update({"length": T, "rep": rep, "cache": how})
                rows.append(m)
                if not args.json:
                    print(
                        f"T={T:<6d} {mode:<9s} ttft {m['ttft_s'] * 1e3:9.1f} ms   peak "
                        f"{memory.format_bytes(m['peak_memory_bytes']):>11s}   read "
                        f"{memory.format_bytes(m['bytes_read']):>11s}   overlap "
                        f"{m['io_compute_overlap'] * 100:5.1f} %   bubble {m['bubble_rate'] * 100:5.1f} %"
                        + (f"   steal {m['steal_s']:.2f} s" if "steal_s" in m else ""),
                        flush=True,
                    )
    if args.json:
        print(json.dumps({"model": str(args.model), "runs": rows}, indent=1))
    return 0
