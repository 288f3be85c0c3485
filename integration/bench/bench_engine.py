"""End-to-end prefill benchmark: engine `stream` vs engine `resident` vs llama.cpp CPU.

On the synthetic `olmoe-1b-7b` preset (OLMoE-1B-7B's real shapes, Q4_0, ≈ 4 GB; or another with
``--preset``: ``deepseek-v2-lite``, DeepSeek-V2-Lite's shapes, ≈ 8.9 GB; ``lfm2-8b-a1b``,
LFM2-8B-A1B's shapes, ≈ 4.7 GB), prompts of
256/1024/4096 tokens, cold page cache before every run, 2 threads, one fresh process per run:

* engine `stream` under the configurator's choice for a 1.5 GiB budget and that prompt length
  (`estream prefill --budget`: the profile's times scaled to the request, see estream-sched),
* engine `resident` (all experts in memory, same kernels),
* llama.cpp CPU through llama-cpp-python (same GGUF, same tokens, same threads),

and then the same inside a 1.5 GiB memory cgroup (v1 or v2), where llama.cpp pages or is
OOM-killed. Prints a table and writes bench-results/bench_engine.json.

    nox -s bench_engine -- [--preset olmoe-1b-7b|deepseek-v2-lite|lfm2-8b-a1b]
                           [--quant q4_0|q4_k_m|q6_k|q8_0] [--lengths 256,1024,4096]
                           [--budget 1.5GiB] [--pin SIZE|auto] [--no-llama] [--no-cgroup]

``--quant`` synthesizes the file with those GGML types (``q4_k_m``: Q4_K matrices with Q6_K
expert down projections and output, llama.cpp's Q4_K_M mix); the engine computes them as
stored and llama.cpp runs the same file.

``--trace`` adds the engine's per-op table to every stream and resident run (`estream prefill
--op-stats`: time, share, work and GOP/s of each op kind, README of estream-cli: "Reading the
per-op table"), each rate also as a share of this machine's peak for its precision (int8 dot
product, fp32 FMA, bf16 dot product), measured before and after the runs by bench_kernels'
own `measure_peaks` (in a child process on the runs' threads; the better of the two is used).
The tables are printed and stored with the runs (``op_table``) and the peaks as ``peaks_gops``.
A quick look on a tiny model: ``--preset tiny --lengths 64 --no-llama --no-cgroup --trace``.

``--io-tax`` measures what the reads alone cost compute on this machine: after each length's
runs, `resident` once more (system ``resident+reads``) while another process reads the pack's
experts file in 4 MiB ``O_DIRECT`` requests at the `stream` run's average read rate (its bytes
read over its time to first token). ``resident+reads`` over ``resident`` is that cost;
`stream` over ``resident+reads`` is what streaming adds beyond it (reads not hidden, the
schedule's own work). On storage whose reads take no CPU or memory bandwidth from the cores
the first ratio is 1.

``--read-cap BYTES`` measures the configurator's margin for a slower disk (estream-sched:
``read_margin``): after each length's runs, `stream` once more with ``--read-margin 0`` (chosen
for the profiled disk exactly), and both again with the reads of their process capped at BYTES
per second (a block-I/O cgroup on the pack's disk: v1 ``blkio.throttle.read_bps_device`` or v2
``io.max``). The systems are ``stream, read margin 0``, ``stream, reads capped`` and ``stream,
reads capped, read margin 0``; each run records its G, Q, B and the time it waited for reads.

``--pin SIZE|auto`` gives the `stream` runs ``--pin``: experts read once at load and kept (auto:
what the budget leaves over the configuration's predicted memory), so each pass reads that much
less; each run records ``pinned_bytes``, and its peak memory includes them.

``--ik-llama-bench PATH`` (or ``$ESTREAM_IK_LLAMA_BENCH``) adds ik_llama.cpp, a llama.cpp fork
with fused MoE and MLA CPU paths, as one more baseline of the free runs: for each prompt length,
after the same cold-cache drop, ``PATH -m <the GGUF> -p T -n 0 -t THREADS -r 1 -o json`` and
ik's fast CPU flags, ``-fa 1 -fmoe 1 -rtr 1`` (flash attention, fused MoE, weights repacked to
row-interleaved layouts at load), plus ``-mla 3`` for ``deepseek2``; ``--ik-llama-args`` replaces
those flags (llama-bench runs one test per value of a repeated flag, so they are not appended).
llama-bench times its pass after loading the model and a one-token warm-up, so its figure is
compute with the weights in memory (``-rtr 1`` reads them all at load), as `resident` is. The
runs are stored as the system ``ik_llama.cpp`` with tokens/s, the flags and ik's build, and the
summary gains ``resident_over_ik_tokens_per_s`` and ``stream_over_ik_tokens_per_s`` (EStream's
tokens/s ÷ ik's). Nothing of ik_llama.cpp ships here: build its ``llama-bench`` yourself
(``cmake -B build -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release && cmake --build build --target
llama-bench``; built outside a git checkout it reports no commit: give it with
``--ik-llama-commit``). ik_llama.cpp has no ``olmoe`` architecture, so for OLMoE's shapes run
``--arch qwen3moe`` (the default ``olmoe-1b-7b`` preset in Qwen3-MoE's layout, one GGUF all
sides run; its vocabulary is Qwen's); ``--ik-llama-bench`` with an ``olmoe`` file is refused.
``deepseek-v2-lite`` loads as it is: ik converts llama.cpp's MLA tensor layout at load, and
tells V2-Lite (no query LoRA) by its 26 or 27 layers, so a file with fewer layers
(``estream synth --dim n_layers=...``) fails there for want of ``attention.q_lora_rank``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from estream.memory import format_bytes, parse_bytes  # noqa: E402
from estream_cli.bench import cpu_steal_s, drop_page_cache  # noqa: E402

CACHE = ROOT / ".cache" / "models"
RESULTS = ROOT / "bench-results"

#: What a benchmark child process measures itself with: a /proc/self/status field and
#: MemAvailable, in bytes (shared with bench_tasks' children).
CHILD_MEMORY = r"""
def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0
def avail():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0
"""

_LLAMA_CHILD = (
    r"""
import json, os, sys, time
spec = json.loads(sys.argv[1])
"""
    + CHILD_MEMORY
    + r"""
a0 = avail()
import llama_cpp
t0 = time.perf_counter()
tokens = spec["tokens"]
n = len(tokens)
llm = llama_cpp.Llama(model_path=spec["model"], n_ctx=n + 8, n_batch=min(n, 2048), n_ubatch=512,
                      n_threads=spec["threads"], n_threads_batch=spec["threads"], logits_all=False,
                      verbose=False, use_mmap=True, seed=0)
t1 = time.perf_counter()
llm.eval(tokens)
t2 = time.perf_counter()
import resource
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"ttft_s": t2 - t1, "end_to_end_s": t2 - t0, "peak_rss_bytes": status("VmHWM"),
                  "mem_available_drop_bytes": max(0, a0 - avail()), "major_faults": ru.ru_majflt}))
"""
)


class _ChildGroup:
    """A cgroup this benchmark made (``path``; None when it could not) that a child joins
    before it starts (`preexec`) and that `close` removes."""

    path: Path | None = None

    def preexec(self) -> Any:
        path = self.path

        def enter() -> None:
            assert path is not None
            (path / "cgroup.procs").write_text(str(os.getpid()))

        return enter

    def close(self) -> None:
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.rmdir()
            self.path = None


class Cgroup(_ChildGroup):
    """A memory-capped cgroup (v2 if mounted as such, else v1) for child processes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.path: Path | None = None
        name = f"estream-bench-{os.getpid()}"
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        v1 = Path("/sys/fs/cgroup/memory")
        try:
            if v2.exists():
                self.path = Path("/sys/fs/cgroup") / name
                self.path.mkdir()
                (self.path / "memory.max").write_text(str(limit))
                (self.path / "memory.swap.max").write_text("0")
            elif v1.is_dir():
                self.path = v1 / name
                self.path.mkdir()
                (self.path / "memory.limit_in_bytes").write_text(str(limit))
        except OSError as exc:
            self.error = str(exc)
            self.path = None
        else:
            self.error = None


def _whole_disk(dev: int) -> str:
    """``MAJ:MIN`` of the disk holding device ``dev`` (a partition's parent: block-I/O limits
    are set on whole disks)."""
    node = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if (node / "partition").exists():
        return (node.resolve().parent / "dev").read_text().strip()
    return f"{os.major(dev)}:{os.minor(dev)}"


class ReadCap(_ChildGroup):
    """A cgroup whose processes read at most ``bps`` bytes/s from the disk holding ``path``
    (v2 ``io.max`` if cgroup v2 is mounted, else v1 ``blkio.throttle.read_bps_device``)."""

    def __init__(self, bps: int, path: Path) -> None:
        self.bps = bps
        self.path: Path | None = None
        self.error: str | None = None
        name = f"estream-bench-io-{os.getpid()}"
        disk = _whole_disk(path.stat().st_dev)
        try:
            if Path("/sys/fs/cgroup/cgroup.controllers").exists():
                self.path = Path("/sys/fs/cgroup") / name
                self.path.mkdir()
                (self.path / "io.max").write_text(f"{disk} rbps={bps}")
            elif Path("/sys/fs/cgroup/blkio").is_dir():
                self.path = Path("/sys/fs/cgroup/blkio") / name
                self.path.mkdir()
                (self.path / "blkio.throttle.read_bps_device").write_text(f"{disk} {bps}")
            else:
                self.error = "no block-I/O cgroup controller mounted"
        except OSError as exc:
            self.error = f"{disk}: {exc}"
            self.close()


def _data_limit(limit: int) -> Any:
    def enter() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

    return enter


def _run(
    cmd: list[str],
    *,
    cgroup: Cgroup | None = None,
    timeout: float = 3600,
    data_limit: int | None = None,
    preexec: Any = None,
) -> dict[str, Any]:
    """Run one child (``preexec``: run in it before it starts, e.g. to join a cgroup);
    `data_limit` caps its private memory (RLIMIT_DATA: anonymous and private
    writable mappings, not a read-only mmap of the model), so a child that would need more than
    the machine has fails its own allocation instead of invoking the system-wide OOM killer."""
    t0 = time.perf_counter()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if preexec is None:
        preexec = cgroup.preexec() if cgroup else _data_limit(data_limit) if data_limit else None
    steal0 = cpu_steal_s()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, preexec_fn=preexec)
    wall = time.perf_counter() - t0
    steal1 = cpu_steal_s()
    # the hypervisor's steal over the whole child (machine-wide): on this project's VMs streamed
    # runs lose wall-clock time to it while their reads are served, resident ones do not
    steal = steal1 - steal0 if steal0 is not None and steal1 is not None else None
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU seconds of the whole child (load and prefill), user + system: on a machine shared
    # with other jobs the wall-clock times stretch with the load, its CPU time much less so
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    load = os.getloadavg()[0]
    if proc.returncode != 0:
        killed = proc.returncode in (-9, 137)
        return {
            "error": "OOM-killed" if killed else f"exit {proc.returncode}",
            "stderr": proc.stderr.strip()[-400:],
            "wall_s": wall,
            "child_cpu_s": cpu,
            "loadavg_1min": load,
        }
    out = proc.stdout.strip().splitlines()
    doc = json.loads("\n".join(out[out.index("{") :]) if "{" in out else out[-1])
    m = doc.get("metrics", doc)
    m["wall_s"] = wall
    m["child_cpu_s"] = cpu
    m["loadavg_1min"] = load
    if steal is not None:
        m["steal_s"] = steal
    m["peak_memory_bytes"] = max(
        int(m.get("peak_rss_bytes", 0)), int(m.get("mem_available_drop_bytes", 0))
    )
    return m


#: bench_kernels, whose `measure_peaks` gives the peaks the per-op table is read against.
KERNELS_BENCH = ROOT / "packages" / "estream-htp" / "bench"

_PEAKS_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import bench_kernels
import estream_htp as htp
htp.set_num_threads(bench_kernels.THREADS)
print(json.dumps(bench_kernels.measure_peaks()))
"""


def measure_peaks(threads: int) -> dict[str, float | None]:
    """bench_kernels' measured peaks (GOP/s, 2 per multiply-add, per precision: "int8",
    "fp32", "bf16", and "int8_step", the int8 dot product in the Q4_0 / Q8_0 kernels' mix;
    None: no such instruction) on ``threads`` threads, in a child process
    with the environment bench_kernels sets itself (so that it does not re-execute)."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
    }
    env.update({"BENCH_THREADS": str(threads), "OPENBLAS_NUM_THREADS": str(threads)})
    proc = subprocess.run(
        [sys.executable, "-c", _PEAKS_CHILD, str(KERNELS_BENCH)],
        capture_output=True, text=True, env=env, timeout=600, check=True,
    )  # fmt: skip
    return json.loads(proc.stdout.strip().splitlines()[-1])


def best_peaks(*measured: dict[str, float | None]) -> dict[str, float | None]:
    """Per precision, the best of several measurements (a peak measured at a busy moment of a
    shared machine is low)."""
    keys = {k for m in measured for k in m}
    return {
        k: max((m[k] for m in measured if m.get(k) is not None), default=None)  # type: ignore[type-var]
        for k in sorted(keys)
    }


def engine_cmd(model: Path, tokens: np.ndarray, mode: str, threads: int) -> list[str]:
    return [
        sys.executable, "-m", "estream_cli.main", "prefill", str(model), "--mode", mode,
        "--tokens", ",".join(str(int(t)) for t in tokens), "--json", "--threads", str(threads),
    ]  # fmt: skip


def llama_cmd(gguf: Path, tokens: np.ndarray, threads: int) -> list[str]:
    spec = {"model": str(gguf), "tokens": [int(t) for t in tokens], "threads": threads}
    return [sys.executable, "-c", _LLAMA_CHILD, json.dumps(spec)]


#: ``--io-tax``: a paced reader in its own process. It reads ``path`` round and round in 4 MiB
#: requests (``O_DIRECT`` where the filesystem allows it) at ``rate`` bytes/s until SIGTERM, then
#: prints the bytes it read and the seconds it ran.
_READER = r"""
import mmap, os, signal, sys, time
path, rate = sys.argv[1], float(sys.argv[2])
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
try:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
except OSError:
    fd = os.open(path, os.O_RDONLY)
size, step = os.fstat(fd).st_size, 4 << 20
buf = mmap.mmap(-1, step)
off = done = 0
t0 = time.perf_counter()
while not stop:
    if off + step > size:
        off = 0
    n = os.preadv(fd, [buf], off)
    if n <= 0:
        break
    done, off = done + n, off + step
    ahead = done / rate - (time.perf_counter() - t0)
    while ahead > 0 and not stop:  # short sleeps: a SIGTERM is answered within 50 ms
        time.sleep(min(ahead, 0.05))
        ahead = done / rate - (time.perf_counter() - t0)
print(done, time.perf_counter() - t0, flush=True)
"""


def start_reader(path: Path, rate: float) -> subprocess.Popen[str]:
    """The paced reader of ``path`` at ``rate`` bytes/s (`_READER`), started now."""
    cmd = [sys.executable, "-c", _READER, str(path), repr(float(rate))]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def stop_reader(proc: subprocess.Popen[str]) -> tuple[int, float]:
    """Stop a `start_reader` process: the bytes it read and the seconds it ran."""
    proc.terminate()
    out, _ = proc.communicate(timeout=60)
    done, secs = out.split()
    return int(done), float(secs)


#: ik_llama.cpp's fast CPU flags for prefill: flash attention, fused MoE (up/gate/down of the
#: routed experts in one op), weights repacked at load into its row-interleaved layouts.
IK_ARGS = ("-fa", "1", "-fmoe", "1", "-rtr", "1")
#: ... plus, for MLA models, its MLA mode 3 (attention on the compressed KV cache, prompt
#: processing through the decompressed K and V).
IK_MLA_ARGS = ("-mla", "3")


def ik_default_args(arch: str) -> list[str]:
    """The flags ik_llama.cpp's llama-bench runs with for a model of the family `arch`."""
    return [*IK_ARGS, *(IK_MLA_ARGS if arch == "deepseek2" else ())]


def parse_llama_bench(stdout: str, tokens: int) -> dict[str, Any]:
    """The prompt-processing result of `llama-bench -o json` for ``tokens`` prompt tokens (its
    JSON list follows any log lines): time, tokens/s and the build that measured them. Raises
    ValueError saying what is missing."""
    start = stdout.find("[")
    if start < 0:
        raise ValueError("llama-bench printed no JSON")
    rows = [
        r for r in json.loads(stdout[start:])
        if int(r.get("n_prompt", -1)) == tokens and int(r.get("n_gen", 0)) == 0
    ]  # fmt: skip
    if len(rows) != 1:
        raise ValueError(f"llama-bench printed {len(rows)} results for pp{tokens}, not one")
    r = rows[0]
    return {
        "ttft_s": float(r["avg_ns"]) / 1e9,
        "tokens_per_s": float(r["avg_ts"]),
        "build_commit": r.get("build_commit"),
        "build_number": r.get("build_number"),
    }


# Runs llama-bench as its own child: its peak RSS (wait4), the MemAvailable drop over it and its
# parsed result, in the shape of the other children's output.
_IK_CHILD = (
    r"""
import json, os, subprocess, sys, tempfile
spec = json.loads(sys.argv[1])
sys.path.insert(0, spec["here"])
"""
    + CHILD_MEMORY
    + r"""
a0 = avail()
with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
    proc = subprocess.Popen(spec["cmd"], stdout=out, stderr=err, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    drop = max(0, a0 - avail())
    out.seek(0), err.seek(0)
    stdout, stderr = out.read(), err.read()
code = os.waitstatus_to_exitcode(status)
if code != 0:
    sys.stderr.write(stderr[-4000:])
    sys.exit(code if code > 0 else 128 - code)
from bench_engine import parse_llama_bench
try:
    m = parse_llama_bench(stdout, spec["tokens"])
except ValueError as exc:
    sys.exit(f"{exc}: {stdout[-400:]}")
m.update({"peak_rss_bytes": usage.ru_maxrss * 1024, "mem_available_drop_bytes": drop,
          "major_faults": usage.ru_majflt, "ik_args": spec["args"]})
print(json.dumps(m))
"""
)


def ik_build(rows: list[dict[str, Any]], given: str | None) -> dict[str, Any]:
    """The ik_llama.cpp build the runs report (their first successful one), the commit
    ``given`` standing in, marked as given, where llama-bench reports none or "unknown"."""
    built = next((r for r in rows if r["system"] == "ik_llama.cpp" and "ttft_s" in r), {})
    commit = built.get("build_commit")
    if commit in (None, "unknown") and given:
        commit = f"{given} (given)"
    return {"build_commit": commit, "build_number": built.get("build_number")}


def llama_bench_argv(
    exe: str, gguf: Path, tokens: int, threads: int, args: list[str] | tuple[str, ...] = ()
) -> list[str]:
    """A llama-bench (llama.cpp's or ik_llama.cpp's) command line: one prompt-processing test
    of ``tokens`` tokens, no generation, one repetition, JSON out, then ``args``."""
    return [exe, "-m", str(gguf), "-p", str(tokens), "-n", "0", "-t", str(threads), "-r", "1",
            "-o", "json", *args]  # fmt: skip


def ik_cmd(exe: str, gguf: Path, tokens: int, threads: int, args: list[str]) -> list[str]:
    """A child that runs ik_llama.cpp's llama-bench once on ``tokens`` prompt tokens."""
    cmd = llama_bench_argv(exe, gguf, tokens, threads, args)
    spec = {"cmd": cmd, "tokens": tokens, "args": args, "here": str(HERE)}
    return [sys.executable, "-c", _IK_CHILD, json.dumps(spec)]


#: ``--quant``: the GGML types of a synthesized file, as llama.cpp's presets of those names mix
#: them (Q4_K_M: Q4_K matrices, Q6_K expert down projections and output).
QUANTS: dict[str, dict[str, str]] = {
    "q4_0": {},
    "q4_k_m": {
        "expert_type": "Q4_K", "expert_down_type": "Q6_K", "dense_type": "Q4_K",
        "output_type": "Q6_K",
    },
    "q6_k": {"expert_type": "Q6_K", "dense_type": "Q6_K", "output_type": "Q6_K"},
    "q8_0": {"expert_type": "Q8_0", "dense_type": "Q8_0", "output_type": "Q8_0"},
}  # fmt: skip


def model_paths(arch: str, preset: str, seed: int = 0, quant: str = "q4_0") -> tuple[Path, Path]:
    """Where the benchmarks keep a synthetic preset's GGUF and its pack (gitignored cache)."""
    stem = f"{arch}-{preset}-s{seed}" + ("" if quant == "q4_0" else f"-{quant}")
    return CACHE / f"{stem}.gguf", CACHE / f"{stem}.estream"


def ensure_profile(dst: Path, threads: int | None = None) -> None:
    """Profile the packed model at ``threads`` (default: the engine's) when it has no profile
    or a stale one (measured with other kernels, CPU, threads or expert formats, or not saying
    what with: `estream.config.profile_staleness`); a current profile is reused."""
    from estream.config import profile_staleness, store_profile
    from estream.engine import DEFAULT_THREADS
    from estream.packed import PackedModel
    from estream.profiling import profile_model

    model = PackedModel(dst)
    n_threads = int(threads or DEFAULT_THREADS)
    stale = profile_staleness(model, n_threads)
    if stale == []:
        return
    if stale:
        print(f"stored profile is stale: {'; '.join(stale)}", flush=True)
    print("profiling (one calibration request per g) …", flush=True)
    t0 = time.perf_counter()
    prof = profile_model(dst, n_threads=n_threads, log=print)
    store_profile(model, prof)
    print(f"  profiled in {time.perf_counter() - t0:.0f} s", flush=True)


def configure_and_store(dst: Path, budget: int) -> Any:
    """The configurator's (G, Q, B) for `budget`, stored in the manifest (used by `prefill`)."""
    from estream.config import configure_for_budget, store_config
    from estream.packed import PackedModel

    model = PackedModel(dst)
    choice = configure_for_budget(model, budget)
    store_config(model, choice, budget)
    print(
        f"config for {format_bytes(budget)}: G={choice.G} Q={choice.Q} B={choice.B} "
        f"(predicted memory {format_bytes(choice.memory_bytes)})",
        flush=True,
    )
    return choice


def prepare(
    preset: str,
    budget: int,
    seed: int = 0,
    arch: str = "olmoe",
    quant: str = "q4_0",
    threads: int | None = None,
) -> tuple[Path, Path]:
    from estream_layout import LayoutError, Manifest, pack_model, synth_model

    CACHE.mkdir(parents=True, exist_ok=True)
    src, dst = model_paths(arch, preset, seed, quant)
    if not src.exists():
        print(f"synthesizing {src} ({quant}) …", flush=True)
        t0 = time.perf_counter()
        synth_model(arch, preset, src, seed=seed, **QUANTS[quant])
        print(f"  {format_bytes(src.stat().st_size)} in {time.perf_counter() - t0:.1f} s")
    try:
        Manifest.from_path(dst)  # also refuses a cached pack of an older format version
        fresh = False
    except LayoutError:
        fresh = True
    if fresh:
        print(f"packing {dst} …", flush=True)
        pack_model(src, dst, force=True, progress=True)
    ensure_profile(dst, threads)  # the runs' threads: a profile at others is stale for them
    configure_and_store(dst, budget)
    return src, dst


#: ``--io-tax``: the system name of `resident` runs beside the paced reader.
IO_TAX = "resident+reads"
#: ``--read-cap``: the system names of its `stream` runs (margin 0 free; margin default and 0
#: under the cap).
NO_MARGIN, CAPPED, CAPPED_NO_MARGIN = (
    "stream, read margin 0",
    "stream, reads capped",
    "stream, reads capped, read margin 0",
)
#: ``--pairs``: the system names of the extra `stream` / `resident` runs.
PAIRED = {"stream": "stream, pair", "resident": "resident, pair"}


def pair_ratios(rows: list[dict[str, Any]], length: int) -> list[float]:
    """stream ÷ resident TTFT of each pair at `length`: the main free runs (pair 0), then the
    ``--pairs`` runs by their ``pair`` index; a pair with a failed side is left out."""

    def ttft(system: str, pair: int) -> float | None:
        for r in rows:
            if (r["system"] == system and r["length"] == length and not r["cgroup"]
                    and r.get("pair", 0) == pair and r.get("ttft_s")):  # fmt: skip
                return float(r["ttft_s"])
        return None

    pairs = sorted({r.get("pair", 0) for r in rows if r["system"] in PAIRED.values()} | {0})
    out = []
    for i in pairs:
        sides = ("stream", "resident") if i == 0 else (PAIRED["stream"], PAIRED["resident"])
        s, r = ttft(sides[0], i), ttft(sides[1], i)
        if s and r:
            out.append(s / r)
    return out


def run_system(
    system: str,
    T: int,
    *,
    src: Path,
    dst: Path,
    n_vocab: int,
    threads: int,
    timeout: float,
    cgroup: Cgroup | None = None,
    engine_args: tuple[str, ...] = (),
    label: str = "",
    data_limit: int | None = None,
    ik: tuple[str, list[str]] | None = None,
    background: tuple[Path, float] | None = None,
    read_cap: ReadCap | None = None,
) -> dict[str, Any]:
    """One cold-cache prefill of `T` random tokens in a fresh process: `stream`/`resident`
    engine, `llama.cpp`, or `ik_llama.cpp` (``ik``: its llama-bench and flags; T tokens of its
    own); prints one line and returns the metrics (or the error: OOM kill, time limit).
    ``background`` (a file and bytes/s): a paced reader of that file runs beside the child;
    ``read_cap``: the child's reads are capped (`ReadCap`)."""
    tokens = np.random.default_rng(T).integers(0, n_vocab, size=T)
    how = drop_page_cache([src, dst / "experts.bin", dst / "dense.bin"])
    if system == "ik_llama.cpp":
        assert ik is not None
        cmd = ik_cmd(ik[0], src, T, threads, ik[1])
    elif system == "llama.cpp":
        cmd = llama_cmd(src, tokens, threads)
    else:
        cmd = [*engine_cmd(dst, tokens, system, threads), *engine_args]
    reader = start_reader(*background) if background is not None else None
    try:
        pre = read_cap.preexec() if read_cap is not None else None
        m = _run(cmd, cgroup=cgroup, timeout=timeout, data_limit=data_limit, preexec=pre)
    except subprocess.TimeoutExpired:
        m = {"error": f"did not finish in {timeout:.0f} s", "timeout_s": timeout}
    finally:
        read = stop_reader(reader) if reader is not None else None
    if background is not None and read is not None:
        m["background_read_target_bytes_per_s"] = background[1]
        m["background_read_bytes_per_s"] = read[0] / read[1] if read[1] > 0 else 0.0
    m.update({"system": system, "length": T, "cache": how, "cgroup": bool(cgroup)})
    if read_cap is not None:
        m["read_cap_bytes_per_s"] = read_cap.bps
    ttft = f"{m['ttft_s']:8.2f} s" if "ttft_s" in m else f"{m.get('error', '?'):>10s}"
    peak = format_bytes(m["peak_memory_bytes"]) if "peak_memory_bytes" in m else "-"
    rss = format_bytes(m["peak_rss_bytes"]) if "peak_rss_bytes" in m else "-"
    cap = f" [cgroup {format_bytes(cgroup.limit)}]" if cgroup else ""
    extra = f"  majflt {m['major_faults']}" if "major_faults" in m else ""
    if "child_cpu_s" in m:
        extra += f"  cpu {m['child_cpu_s']:.1f} s  load {m['loadavg_1min']:.1f}"
    if "steal_s" in m:
        extra += f"  steal {m['steal_s']:.2f} s"
    print(
        f"T={T:<5d} {system + label:<12s} TTFT {ttft}  peak {peak:>11s} (RSS {rss:>11s}){cap}"
        f"{extra}",
        flush=True,
    )
    if "error" in m and m.get("stderr"):  # why: a refused budget, a bad option, ...
        print(f"  ({system}: {m['stderr'].splitlines()[-1]})", flush=True)
    return m


def print_op_tables(rows: list[dict[str, Any]], peaks: dict[str, float | None]) -> None:
    """Each engine run's per-op table, its rates as shares of ``peaks`` (added to the run's
    ``op_table``)."""
    from estream.opstats import add_peaks, format_table

    shown = ", ".join(f"{k} {v:.0f}" if v else f"{k} n/a" for k, v in peaks.items())
    print(f"\nper-op tables (measured peaks, GOP/s: {shown})")
    for r in rows:
        if "op_table" not in r:
            continue
        r["op_table"] = add_peaks(r["op_table"], peaks)
        cap = " (cgroup)" if r.get("cgroup") else ""
        print(f"\n  {r['system']} T={r['length']}{cap}: TTFT {r['ttft_s'] * 1e3:.1f} ms")
        for line in format_table(r["op_table"], indent="    "):
            print(line)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="256,1024,4096")
    ap.add_argument("--budget", default="1.5GiB")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--preset",
        default="olmoe-1b-7b",
        help="olmoe-1b-7b | deepseek-v2-lite (DeepSeek-V2-Lite's shapes: MLA, YaRN, 2 shared "
        "experts, a dense first layer; ≈ 8.9 GB Q4_0) | lfm2-8b-a1b (LFM2-8B-A1B's shapes; ≈ 4.7 GB) "
        "| any estream-synth preset",
    )
    ap.add_argument("--arch", help="architecture (default: the preset's, else olmoe)")
    ap.add_argument(
        "--quant",
        default="q4_0",
        choices=sorted(QUANTS),
        help="GGML types of the synthesized file (q4_k_m: llama.cpp's Q4_K_M mix); default q4_0",
    )
    ap.add_argument(
        "--attention",
        choices=("auto", "f32", "bf16", "bf16-pv"),
        help="the engine runs' --attention (default: the engine's); each run records what ran",
    )
    ap.add_argument(
        "--pin",
        help="the stream runs' --pin (a size, or auto: what the budget leaves over the "
        "configuration's predicted memory); each run records the bytes it pinned",
    )
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--no-cgroup", action="store_true")
    ap.add_argument("--skip-free", action="store_true", help="only the memory-capped runs")
    ap.add_argument("--cgroup-lengths", help="lengths for the capped runs (default: --lengths)")
    ap.add_argument(
        "--cgroup-timeout", type=float, default=900.0, help="seconds before a capped run is cut"
    )
    ap.add_argument("--out", default="bench_engine.json")
    ap.add_argument(
        "--trace",
        action="store_true",
        help="per-op table of every engine run (time, share, GOP/s, share of the measured peak)",
    )
    ap.add_argument(
        "--io-tax",
        action="store_true",
        help="after each length's runs, `resident` once more while another process reads the "
        "pack's experts file at the stream run's read rate: what the reads alone cost compute",
    )
    ap.add_argument(
        "--pairs",
        type=int,
        default=0,
        metavar="N",
        help="after each length's runs, N more `stream` / `resident` pairs in alternating order "
        "(resident first in the first): stream ÷ resident as the median of the pairs' ratios, "
        "the main runs' pair included, so one run's noise does not decide it",
    )
    ap.add_argument(
        "--read-cap",
        metavar="BYTES",
        help="after each length's runs, `stream` with --read-margin 0, and both stream runs "
        "again with their reads capped at BYTES/s (e.g. 2GB): the configurator's margin for a "
        "slower disk",
    )
    ap.add_argument(
        "--ik-llama-bench",
        default=os.environ.get("ESTREAM_IK_LLAMA_BENCH") or None,
        metavar="PATH",
        help="ik_llama.cpp's llama-bench executable (or $ESTREAM_IK_LLAMA_BENCH): one more "
        "baseline of the free runs, tokens/s and EStream's tokens/s over it",
    )
    ap.add_argument(
        "--ik-llama-args",
        help="llama-bench flags instead of ik's fast CPU ones ('-fa 1 -fmoe 1 -rtr 1', "
        "plus '-mla 3' for deepseek2)",
    )
    ap.add_argument(
        "--ik-llama-commit",
        help="the ik_llama.cpp commit llama-bench was built from, recorded when llama-bench "
        "reports none (a build outside a git checkout says 'unknown')",
    )
    args = ap.parse_args()
    if args.pairs < 0:
        ap.error(f"--pairs: {args.pairs} is negative")
    budget = parse_bytes(args.budget)
    lengths = [int(x) for x in args.lengths.split(",")]
    from estream_layout import PRESET_ARCH

    arch = args.arch or PRESET_ARCH.get(args.preset, "olmoe")
    ik: tuple[str, list[str]] | None = None
    if args.ik_llama_bench:
        exe = Path(args.ik_llama_bench)
        if not (exe.is_file() and os.access(exe, os.X_OK)):
            ap.error(f"--ik-llama-bench: {exe} is not an executable file")
        if arch == "olmoe":
            ap.error(
                "--ik-llama-bench: ik_llama.cpp has no olmoe architecture; run OLMoE's shapes "
                "in Qwen3-MoE's layout: --arch qwen3moe --preset olmoe-1b-7b"
            )
        ik_args = (
            shlex.split(args.ik_llama_args)
            if args.ik_llama_args is not None
            else ik_default_args(arch)
        )
        ik = (str(exe.resolve()), ik_args)
    elif args.ik_llama_args is not None or args.ik_llama_commit is not None:
        ap.error("--ik-llama-args and --ik-llama-commit need --ik-llama-bench")
    src, dst = prepare(args.preset, budget, arch=arch, quant=args.quant, threads=args.threads)
    from estream.packed import PackedModel

    hp = PackedModel(dst).hparams
    llama_ok = False
    if not args.no_llama:
        try:
            from llamacpp import ensure_llama_cpp

            ensure_llama_cpp()
            llama_ok = True
        except Exception as exc:  # report, do not hide: the table says why the column is empty
            print(f"llama.cpp unavailable: {exc}", flush=True)
    rows: list[dict[str, Any]] = []
    systems = ["stream", "resident"] + (["llama.cpp"] if llama_ok else [])
    systems += ["ik_llama.cpp"] if ik else []
    peaks_start = measure_peaks(args.threads) if args.trace else None

    def one(system: str, T: int, cg: Cgroup | None, trace: bool = True) -> dict[str, Any]:
        timeout = args.cgroup_timeout if cg else 3600.0
        # stream: the budget's configuration for this prompt length, chosen by `prefill` itself
        extra: tuple[str, ...] = ("--budget", str(budget)) if system == "stream" else ()
        if args.trace and trace and system in ("stream", "resident"):
            extra += ("--op-stats",)
        if args.pin and system == "stream":
            extra += ("--pin", args.pin)
        if args.attention and system in ("stream", "resident"):
            extra += ("--attention", args.attention)
        m = run_system(
            system, T, src=src, dst=dst, n_vocab=hp.n_vocab, threads=args.threads,
            timeout=timeout, cgroup=cg, engine_args=extra, ik=ik,
        )  # fmt: skip
        if system == "stream" and "G" in m:  # what the run used (its own metrics)
            pins = f", {format_bytes(m['pinned_bytes'])} pinned" if m.get("pinned_bytes") else ""
            print(
                f"  (stream at T={T} ran with G={m['G']} Q={m['Q']} B={m['B']}{pins})", flush=True
            )
        return m

    def under_reads(T: int) -> dict[str, Any]:
        """`resident` at T while a paced reader reads the experts file at the rate of this
        length's `stream` run (its bytes read over its time to first token)."""
        s = next((r for r in rows if r["system"] == "stream" and r["length"] == T), {})
        if not (s.get("bytes_read") and s.get("ttft_s")):
            return {"system": IO_TAX, "length": T, "cgroup": False,
                    "error": "no stream run with reads to take the rate from"}  # fmt: skip
        rate = s["bytes_read"] / s["ttft_s"]
        extra: tuple[str, ...] = ("--op-stats",) if args.trace else ()
        extra += ("--attention", args.attention) if args.attention else ()
        m = run_system(
            "resident", T, src=src, dst=dst, n_vocab=hp.n_vocab, threads=args.threads,
            timeout=3600.0, engine_args=extra, label=" + reads",
            background=(dst / "experts.bin", rate),
        )  # fmt: skip
        m["system"] = IO_TAX
        return m

    def margins(T: int, cap: ReadCap) -> list[dict[str, Any]]:
        """`stream` at T chosen without a margin, then both choices under the read cap."""
        out = []
        for system, capped, zero in (
            (NO_MARGIN, None, True), (CAPPED, cap, False), (CAPPED_NO_MARGIN, cap, True)
        ):  # fmt: skip
            extra: tuple[str, ...] = ("--budget", str(budget))
            extra += ("--read-margin", "0") if zero else ()
            extra += ("--pin", args.pin) if args.pin else ()  # as the `stream` runs
            extra += ("--op-stats",) if args.trace else ()
            extra += ("--attention", args.attention) if args.attention else ()
            m = run_system(
                "stream", T, src=src, dst=dst, n_vocab=hp.n_vocab, threads=args.threads,
                timeout=3600.0, engine_args=extra, label=system.removeprefix("stream"),
                read_cap=capped,
            )  # fmt: skip
            m["system"] = system
            if "G" in m:
                print(f"  ({system} at T={T} ran with G={m['G']} Q={m['Q']} B={m['B']})")
            out.append(m)
        return out

    read_cap = None
    if args.read_cap:
        read_cap = ReadCap(parse_bytes(args.read_cap), dst / "experts.bin")
        if read_cap.path is None:
            ap.error(f"--read-cap: cannot cap reads here ({read_cap.error})")
    try:
        if not args.skip_free:
            for T in lengths:
                for system in systems:
                    rows.append(one(system, T, None))
                for i in range(args.pairs):  # (no per-op tables: the main runs have them)
                    for system in ("resident", "stream") if i % 2 == 0 else ("stream", "resident"):
                        m = one(system, T, None, trace=False)
                        m["system"], m["pair"] = PAIRED[system], i + 1
                        rows.append(m)
                if args.io_tax:
                    rows.append(under_reads(T))
                if read_cap is not None:
                    rows += margins(T, read_cap)
    finally:
        if read_cap is not None:
            read_cap.close()
    cg_lengths = [int(x) for x in (args.cgroup_lengths or args.lengths).split(",")]
    cg_note = None
    if not args.no_cgroup:
        cg = Cgroup(budget)
        if cg.path is None:
            cg_note = f"no memory cgroup: {cg.error}"
            print(cg_note)
        else:
            try:
                for T in cg_lengths:
                    for system in ["stream"] + (["llama.cpp"] if llama_ok else []):
                        rows.append(one(system, T, cg))
            finally:
                cg.close()

    peaks = None
    if peaks_start is not None:
        peaks = best_peaks(peaks_start, measure_peaks(args.threads))
        print_op_tables(rows, peaks)

    def get(system: str, T: int, cg: bool, key: str) -> float | None:
        for r in rows:
            if r["system"] == system and r["length"] == T and r["cgroup"] == cg and key in r:
                return float(r[key])
        return None

    print("\nratios (same run):")
    summary = []
    for T in lengths:
        s, r, lc = (get(x, T, False, "ttft_s") for x in ("stream", "resident", "llama.cpp"))
        sm, rm, lm = (
            get(x, T, False, "peak_memory_bytes") for x in ("stream", "resident", "llama.cpp")
        )
        row = {"length": T}
        if s and r:
            row["stream_over_resident_ttft"] = s / r
            row["stream_over_resident_peak"] = sm / rm if sm and rm else None
        if s and lc:
            row["stream_over_llama_ttft"] = s / lc
            row["stream_over_llama_peak"] = sm / lm if sm and lm else None
        if args.pairs:
            row["stream_over_resident_pairs"] = pair_ratios(rows, T)
        rr = get(IO_TAX, T, False, "ttft_s")
        if rr and r:
            row["resident_reads_over_resident_ttft"] = rr / r
        if rr and s:
            row["stream_over_resident_reads_ttft"] = s / rr
        for system, key in ((NO_MARGIN, "no_margin"), (CAPPED, "capped"),
                            (CAPPED_NO_MARGIN, "capped_no_margin")):  # fmt: skip
            t = get(system, T, False, "ttft_s")
            if t and r:
                row[f"stream_{key}_over_resident_ttft"] = t / r
        ik_t = get("ik_llama.cpp", T, False, "ttft_s")
        if ik_t:  # tokens/s over ik's tokens/s: ik's time over EStream's, same T
            row["ik_tokens_per_s"] = T / ik_t
            if r:
                row["resident_over_ik_tokens_per_s"] = ik_t / r
            if s:
                row["stream_over_ik_tokens_per_s"] = ik_t / s
        summary.append(row)
        print(
            "  "
            + "  ".join(
                f"{k}={v:.3f}"
                if isinstance(v, float)
                else f"{k}=[{', '.join(f'{x:.3f}' for x in v)}]"
                if isinstance(v, list)
                else f"{k}={v}"
                for k, v in row.items()
            )
        )
    RESULTS.mkdir(exist_ok=True)
    doc = {
        "model": str(dst),
        "quant": args.quant,
        "budget_bytes": budget,
        "threads": args.threads,
        "runs": rows,
        "summary": summary,
        "cgroup_note": cg_note,
    }
    if args.read_cap:
        import estream_sched as es

        doc["read_cap_bytes_per_s"] = parse_bytes(args.read_cap)
        doc["read_margin_default"] = es.DEFAULT_READ_MARGIN  # what the plain `stream` runs had
    if peaks is not None:
        doc["peaks_gops"] = peaks
    if ik is not None:
        doc["ik_llama"] = {
            "llama_bench": ik[0], "args": ik[1], "gguf": str(src),
            **ik_build(rows, args.ik_llama_commit),
        }  # fmt: skip
    (RESULTS / args.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {RESULTS / args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
