"""One benchmark run as one JSON file: the machine it ran on, its load and steal around the run,
the commit, the exact command and the benchmark script's own figures.

`nox -s bench_*` (noxfile.py `_bench`) calls `sample()` before and after the script, then
`record()`, which wraps the figures file the script wrote into
``benchmarks/results/<bench>/<UTC time>-<commit>.json``. `report` renders the latest of each.

Result schema (version 1), every key always present:

* ``schema`` 1; ``bench`` the benchmark's name (a key of `BENCHES`);
* ``transcribed`` false for a recorded run; true for figures copied from earlier prose, which
  then carry ``source`` (where the text was) and ``note``, and null where the text says nothing;
* ``date`` UTC, ISO 8601 (``YYYY-MM-DDTHH:MM:SSZ``; a transcribed one may be a bare date or null);
* ``commit`` the checked-out commit, ``dirty`` whether tracked files differed from it;
* ``command`` what was typed (``nox -s bench_engine -- --lengths 1024``) and ``script_command``
  the script's argv, paths relative to the repository;
* ``machine``: ``cpu_model``, ``cores``, ``arch``, ``simd_flags`` (the SIMD-relevant subset of
  ``cpu_flags``), ``cpu_flags`` (all of /proc/cpuinfo's);
* ``load_average_1min``: ``{"before": x, "after": y}``; ``steal_s`` the hypervisor's steal over
  the run, summed over CPUs (null where the kernel does not count it); ``wall_s``;
* ``figures``: the script's JSON output, unchanged.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
FIGURES = ROOT / "bench-results"

#: Every recorded benchmark and the figures file its script writes into bench-results/.
BENCHES: dict[str, str] = {
    "bench_engine": "bench_engine.json",
    "bench_tasks": "bench_tasks.json",
    "bench_ray": "bench_ray.json",
    "bench_vs_llama": "vs_llama_bench.json",
    "bench_scale": "bench_scale.json",
    "bench_kernels": "bench_kernels.json",
    "bench_arena": "bench_arena.json",
    "bench_layout": "bench_layout.json",
    "bench_sched": "bench_sched.json",
    "bench_tokenizer": "bench_tokenizer.json",
    "parity": "parity.json",
    "eval_parity": "eval-parity.json",
    "bench_hexagon": "bench_hexagon.json",
    "hexagon_packets": "hexagon_packets.json",
    "neon_instr_mix": "neon_instr_mix.json",
}

#: The /proc/cpuinfo flags that decide which kernels run (x86 and arm64 spellings).
SIMD_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
    "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16",
    "asimd", "asimddp", "i8mm", "bf16", "sve",
)  # fmt: skip

KEYS = (
    "schema", "bench", "transcribed", "date", "commit", "dirty", "command", "script_command",
    "machine", "load_average_1min", "steal_s", "wall_s", "figures",
)  # fmt: skip
MACHINE_KEYS = ("cpu_model", "cores", "arch", "simd_flags", "cpu_flags")


class ResultError(ValueError):
    """A result file or figures file that cannot be recorded or read, with the reason."""


def parse_cpuinfo(text: str) -> dict[str, Any]:
    """The CPU model and flags from the text of /proc/cpuinfo (first CPU; x86 ``model name`` /
    ``flags``, arm64 ``Features``)."""
    model, flags = None, None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if model is None and key in ("model name", "Model", "cpu model"):
            model = value.strip()
        elif flags is None and key in ("flags", "Features"):
            flags = sorted(set(value.split()))
    flags = flags or []
    return {
        "cpu_model": model,
        "simd_flags": [f for f in SIMD_FLAGS if f in flags],
        "cpu_flags": flags,
    }


def machine() -> dict[str, Any]:
    """This machine: CPU model and flags, core count, architecture."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    info = parse_cpuinfo(text)
    return {
        "cpu_model": info["cpu_model"] or platform.processor() or None,
        "cores": os.cpu_count(),
        "arch": platform.machine(),
        "simd_flags": info["simd_flags"],
        "cpu_flags": info["cpu_flags"],
    }


def parse_steal_s(stat: str, ticks_per_s: int) -> float | None:
    """Seconds of steal so far, all CPUs, from the text of /proc/stat: the eighth number of the
    ``cpu`` line (None when the kernel does not report it)."""
    for line in stat.splitlines():
        f = line.split()
        if f and f[0] == "cpu":
            return int(f[8]) / ticks_per_s if len(f) > 8 else None
    return None


def sample() -> dict[str, float | None]:
    """The machine's state now: wall time, 1-minute load average, steal seconds so far."""
    try:
        load: float | None = round(os.getloadavg()[0], 2)
    except OSError:
        load = None
    try:
        steal = parse_steal_s(Path("/proc/stat").read_text(), os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError):
        steal = None
    return {"time": time.time(), "loadavg_1min": load, "steal_s": steal}


def git_state(root: Path = ROOT) -> dict[str, Any]:
    """The checked-out commit and whether tracked files differ from it (nulls outside git)."""

    def git(*args: str) -> str | None:
        try:
            p = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        except OSError:
            return None
        return p.stdout if p.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": commit.strip() if commit else None,
        "dirty": None if commit is None or status is None else bool(status.strip()),
    }


def utc(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def make_result(
    bench: str,
    figures: dict[str, Any],
    *,
    before: dict[str, float | None],
    after: dict[str, float | None],
    command: str,
    script_command: list[str],
    machine_info: dict[str, Any] | None = None,
    git: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The result of one run from the samples taken around it (see the module docstring)."""
    s0, s1 = before["steal_s"], after["steal_s"]
    doc = {
        "schema": SCHEMA_VERSION,
        "bench": bench,
        "transcribed": False,
        "date": utc(float(before["time"])),  # type: ignore[arg-type]
        **(git if git is not None else git_state()),
        "command": command,
        "script_command": script_command,
        "machine": machine_info if machine_info is not None else machine(),
        "load_average_1min": {"before": before["loadavg_1min"], "after": after["loadavg_1min"]},
        "steal_s": None if s0 is None or s1 is None else round(s1 - s0, 2),
        "wall_s": round(float(after["time"]) - float(before["time"]), 2),  # type: ignore[arg-type]
        "figures": figures,
    }
    return validate(doc)


def _check(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise ResultError(f"{where}: {what}")


def validate(doc: Any, where: str = "result") -> dict[str, Any]:
    """`doc` itself if it is a result of this schema; else ResultError naming the first problem."""
    _check(isinstance(doc, dict), where, "not a JSON object")
    missing = [k for k in KEYS if k not in doc]
    _check(not missing, where, f"missing {', '.join(missing)}")
    _check(doc["schema"] == SCHEMA_VERSION, where, f"schema {doc['schema']!r}, expected 1")
    _check(doc["bench"] in BENCHES, where, f"unknown bench {doc['bench']!r}")
    _check(isinstance(doc["transcribed"], bool), where, "transcribed is not true/false")
    _check(isinstance(doc["figures"], dict), where, "figures is not a JSON object")
    m = doc["machine"]
    _check(isinstance(m, dict) and all(k in m for k in MACHINE_KEYS), where, "machine incomplete")
    load = doc["load_average_1min"]
    if doc["transcribed"]:
        _check("source" in doc and "note" in doc, where, "a transcribed result needs source, note")
        _check(load is None, where, "a transcribed result has no recorded load average")
        _check(doc["date"] is None or isinstance(doc["date"], str), where, "bad date")
        stated = doc.get("stated_load_average", [])
        _check(
            isinstance(stated, list) and all(isinstance(v, int | float) for v in stated),
            where, "stated_load_average is not a list of numbers",
        )  # fmt: skip
        return doc
    _check(isinstance(doc["date"], str) and doc["date"].endswith("Z"), where, "date is not UTC")
    try:
        dt.datetime.strptime(doc["date"], "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        raise ResultError(f"{where}: date {doc['date']!r} is not YYYY-MM-DDTHH:MM:SSZ") from None
    _check(isinstance(doc["command"], str) and doc["command"], where, "no command")
    _check(isinstance(doc["script_command"], list), where, "script_command is not a list")
    _check(
        isinstance(load, dict) and set(load) == {"before", "after"}, where, "load average needs "
        "before and after"
    )  # fmt: skip
    _check(isinstance(m["cores"], int) and m["cores"] > 0, where, "no core count")
    _check(isinstance(m["cpu_flags"], list), where, "cpu_flags is not a list")
    return doc


def result_name(doc: dict[str, Any]) -> str:
    """``<UTC time>-<short commit>.json``: sorts by time, names the commit."""
    stamp = doc["date"].replace("-", "").replace(":", "")
    return f"{stamp}-{(doc['commit'] or 'nocommit')[:10]}.json"


def write(doc: dict[str, Any], results: Path | None = None) -> Path:
    """Write a validated result under `results/<bench>/` (temp name, then rename; never over an
    existing file). Returns its path."""
    validate(doc)
    out = (results or RESULTS) / doc["bench"] / result_name(doc)
    if out.exists():
        raise ResultError(f"{out}: already exists (two runs in the same second?)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    tmp.replace(out)
    return out


def load_figures(path: Path, since: float) -> dict[str, Any]:
    """The figures a script wrote at `path` during the run that started at `since`."""
    try:
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        raise ResultError(f"{path}: the benchmark wrote no figures file") from None
    if mtime < since - 1:  # file system timestamps may be coarser than the clock
        raise ResultError(f"{path}: not rewritten by this run (older than its start)")
    try:
        figures = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ResultError(f"{path}: not JSON ({exc})") from None
    if not isinstance(figures, dict):
        raise ResultError(f"{path}: figures are not a JSON object")
    return figures


def record(
    bench: str,
    *,
    before: dict[str, float | None],
    after: dict[str, float | None],
    command: str,
    script_command: list[str],
    figures_dir: Path | None = None,
    results: Path | None = None,
) -> Path:
    """Wrap the figures file `bench`'s script wrote during the run (in `figures_dir`, default
    bench-results/) into a result file (under `results`, default benchmarks/results/)."""
    if bench not in BENCHES:
        raise ResultError(f"unknown bench {bench!r}; known: {', '.join(BENCHES)}")
    path = (figures_dir or FIGURES) / BENCHES[bench]
    figures = load_figures(path, float(before["time"]))  # type: ignore[arg-type]
    doc = make_result(
        bench, figures, before=before, after=after, command=command, script_command=script_command
    )
    return write(doc, results or RESULTS)
