from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
from helpers import LEVELS, SIMD_PARAMS, cpu_flags

import estream_htp as htp
from estream_htp import _buildcfg, _core


def _child(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    e = {**os.environ, **env}
    return subprocess.run(
        [sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("level", SIMD_PARAMS)
def test_env_forces_simd_level(level: str) -> None:
    r = _child("import estream_htp as h; print(h.simd_level())", ESTREAM_HTP_SIMD=level)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == level


def test_env_unsupported_level_is_an_error() -> None:
    missing = [lvl for lvl in _core.SIMD_LEVELS if lvl not in LEVELS]
    r = _child("import estream_htp", ESTREAM_HTP_SIMD=missing[0] if missing else "nosuch")
    assert r.returncode != 0
    assert "SIMD level" in r.stderr


def test_env_threads_and_activation_format() -> None:
    r = _child(
        "import estream_htp as h; print(h.get_num_threads(), h.get_activation_format())",
        ESTREAM_HTP_THREADS="3",
        ESTREAM_HTP_ACT="f32",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["3", "f32"]


def test_thread_count_setter() -> None:
    old = htp.get_num_threads()
    try:
        htp.set_num_threads(1)
        assert htp.get_num_threads() == 1
        with pytest.raises(htp.HTPInputError):
            htp.set_num_threads(0)
    finally:
        htp.set_num_threads(old)


def test_build_switches() -> None:
    c, ld = _buildcfg.compile_flags({})
    assert "-O3" in c and not any("sanitize" in f for f in c + ld)
    assert "-march=native" not in c
    c, ld = _buildcfg.compile_flags(
        {"ESTREAM_HTP_SANITIZE": "1", "ESTREAM_HTP_NO_SIMD": "yes", "ESTREAM_HTP_CFLAGS": "-DX=1"}
    )
    assert "-fsanitize=address,undefined" in c and "-fsanitize=address,undefined" in ld
    assert "-DHTP_NO_SIMD" in c and c[-1] == "-DX=1"


def test_abi_version() -> None:
    assert _core.lib.htp_abi_version() == _core.lib.HTP_ABI_VERSION == 4


_POOL_AFFINITY = r"""
import glob, json, os, sys
if len(sys.argv) > 1:
    os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(",")})
import numpy as np
import estream_htp as htp
htp.set_num_threads(3)  # more workers than a restricted set has CPUs: they wrap around
x = np.ones((512, 2048), np.float32)
htp.add(x, x, np.empty_like(x))  # the workers have run
tasks = {}
for st in glob.glob(f"/proc/{os.getpid()}/task/*/status"):
    for line in open(st):
        if line.startswith("Cpus_allowed_list:"):
            tasks[st.split("/")[4]] = line.split()[1]
print(json.dumps({"allowed": sorted(os.sched_getaffinity(0)), "tasks": tasks}))
"""


def _cpu_list(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


@pytest.mark.skipif(sys.platform != "linux", reason="CPU affinity is Linux's (sched_setaffinity)")
def test_pool_workers_are_left_unpinned() -> None:
    """Workers are started each on another of the creator's CPUs (htp_pool.c: so that a fresh
    process's first ops do not share one CPU) and must widen back to all of them once running:
    every thread of the process, workers included, may run on every CPU the process may, also
    under a restricted set (one CPU, or two with more workers than CPUs)."""
    import json

    cpus = sorted(os.sched_getaffinity(0))
    sets = [None, [cpus[0]]] + ([cpus[:2]] if len(cpus) >= 2 else [])
    for want in sets:
        args = [",".join(map(str, want))] if want else []
        r = subprocess.run(
            [sys.executable, "-c", _POOL_AFFINITY, *args],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert got["allowed"] == (want or cpus)
        assert len(got["tasks"]) >= 3  # the main thread and two workers at least
        for tid, listed in got["tasks"].items():
            assert _cpu_list(listed) == got["allowed"], (want, tid, listed)


def test_forked_child_runs_single_threaded() -> None:
    # a child forked while the pool has workers must not wait for threads it does not have
    import multiprocessing as mp

    import numpy as np

    htp.set_num_threads(2)
    htp.gemm(np.ones((4, 64), np.float32), htp.pack_q4_0_t32r4(np.ones((8, 64), np.float32)), 8)
    ctx = mp.get_context("fork")
    with ctx.Pool(1) as p:
        got = p.apply_async(_child_gemm).get(timeout=60)
    assert got == (1, True)


def _child_gemm() -> tuple[int, bool]:
    import numpy as np

    x = np.ones((4, 64), np.float32)
    y = htp.gemm(x, htp.pack_q4_0_t32r4(np.ones((8, 64), np.float32)), 8)
    n1 = htp.get_num_threads()
    htp.set_num_threads(2)  # and it can grow its own pool again
    y2 = htp.gemm(x, htp.pack_q4_0_t32r4(np.ones((8, 64), np.float32)), 8)
    return n1, bool(np.array_equal(y, y2))


def test_expert_graph_del_swallows_an_interrupt(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C landing while the interpreter collects an ExpertGraph at exit prints no
    "Exception ignored in __del__ ... KeyboardInterrupt" traceback."""
    g = htp.ExpertGraph(32, 32, 8, 8)
    real_close = g.close

    def interrupted() -> None:
        real_close()
        raise KeyboardInterrupt

    monkeypatch.setattr(g, "close", interrupted)
    g.__del__()  # must not raise


@pytest.mark.parametrize("level", SIMD_PARAMS)
def test_mac_peaks(level: str) -> None:
    """The peak micro-measures exist exactly where the level has the instruction: int8 dot
    and fp32 FMA on the AVX2 and AVX-512 levels, bf16 dot there when the CPU has AVX512_BF16 (the
    native bf16 attention condition); a positive finite rate when they run."""
    with htp.Backend("host", n_threads=1, simd=level) as be:
        for kind in ("int8", "fp32", "bf16"):
            has = (
                level in ("avx512", "avx512vnni", "amx")
                and (kind != "bf16" or "avx512_bf16" in cpu_flags())
            ) or (level == "avx2" and kind != "bf16")
            if has:
                rate = _core._mac_peak(kind, 1000, backend=be)
                assert 0 < rate < float("inf")
            else:
                with pytest.raises(htp.HTPUnsupportedError):
                    _core._mac_peak(kind, 1000, backend=be)
        with pytest.raises(htp.HTPInputError, match="kind must be one of"):
            _core._mac_peak("fp64", 1000, backend=be)


@pytest.mark.parametrize("level", SIMD_PARAMS)
def test_int8_step_peak(level: str) -> None:
    """The int8 dot product in the Q4_0 / Q8_0 kernels' mix with their fp32 step is measured on
    the AVX-512 VNNI level only (a positive rate; with its multiplies and FMAs it cannot beat
    the dot product alone by more than the two measurements' noise), and an executor's CPU is
    not this process's to time."""
    with htp.Backend("host", n_threads=1, simd=level) as be:
        if level != "avx512vnni":
            with pytest.raises(htp.HTPUnsupportedError):
                _core._mac_peak("int8_step", 1000, backend=be)
            return
        step = max(_core._mac_peak("int8_step", 200_000, backend=be) for _ in range(3))
        dot = max(_core._mac_peak("int8", 200_000, backend=be) for _ in range(3))
        assert 0 < step < 1.25 * dot
    with htp.Backend("host-process", n_threads=1) as remote, pytest.raises(htp.HTPUnsupportedError):
        _core._mac_peak("int8_step", 1000, backend=remote)


@pytest.mark.parametrize("level", SIMD_PARAMS)
def test_measure_peaks_public(level: str) -> None:
    """`measure_peaks` gives a positive rate exactly for the kinds whose instruction the level
    has and None for the others; a backend in an executor process, whose CPU this process
    cannot time, gives None for every kind; a bad repeat count is refused."""
    with htp.Backend("host", n_threads=1, simd=level) as be:
        peaks = htp.measure_peaks(backend=be, repeats=2, iters=20_000)
        assert set(peaks) == {"int8", "fp32", "bf16"}
        for kind, gops in peaks.items():
            try:
                _core._mac_peak(kind, 1000, backend=be)
            except htp.HTPUnsupportedError:
                assert gops is None, kind
            else:
                assert gops is not None and 0 < gops < float("inf"), kind
        with pytest.raises(htp.HTPInputError, match="repeats must be a positive int"):
            htp.measure_peaks(backend=be, repeats=0)
    with htp.Backend("host-process", n_threads=1) as remote:
        assert htp.measure_peaks(backend=remote, repeats=1, iters=1000) == {
            "int8": None,
            "fp32": None,
            "bf16": None,
        }


def test_measure_peaks_is_the_best_run_in_gop_per_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each kind's figure is the best of its `repeats` runs, counted as 2 ops per multiply-add
    and given in units of 1e9 (runs of one kind never lend their rate to another)."""
    rates = {"int8": [1e9, 4e9, 2e9], "fp32": [5e8, 3e8, 1e8], "bf16": [7e9, 1e9, 6e9]}
    calls: dict[str, int] = {k: 0 for k in rates}

    def fake(kind: str, iters: int = 0, *, backend: object = None) -> float:
        calls[kind] += 1
        return rates[kind][calls[kind] - 1]

    monkeypatch.setattr(_core, "_mac_peak", fake)
    assert htp.measure_peaks(repeats=3) == pytest.approx({"int8": 8.0, "fp32": 1.0, "bf16": 14.0})
    assert calls == {"int8": 3, "fp32": 3, "bf16": 3}


# The x86 kernel sets and the /proc/cpuinfo flags each one needs.
_X86_NEEDS = {
    "avx2": {"avx2", "fma"},
    "avx512": {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "avx512vnni": {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"},
}


@pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 kernel sets (x86 only)"
)
@pytest.mark.parametrize("level", sorted(_X86_NEEDS))
def test_simd_detection_agrees_with_cpuinfo(level: str) -> None:
    """A kernel set is offered exactly when the CPU lists its instructions: the SIMD tests skip
    what this CPU lacks, and this keeps a detection bug from passing as a missing feature."""
    assert htp.simd_supported(level) == (_X86_NEEDS[level] <= cpu_flags()), sorted(
        _X86_NEEDS[level] - cpu_flags()
    )


def test_native_bf16_attention_follows_the_kernel_set_and_the_cpu() -> None:
    """`native_bf16_attention`: AVX-512 and AMX kernel sets count exactly when the CPU has
    AVX512_BF16 (/proc/cpuinfo, independently of the library's detection) and the set runs here;
    portable, AVX2, NEON (its FEAT_BF16 task is slower than its fp32 one) and hexagon's HVX never.
    """
    from types import SimpleNamespace

    def native(level: str) -> bool:
        return htp.native_bf16_attention(SimpleNamespace(simd=level))  # type: ignore[arg-type]

    bf16_cpu = {"avx512f", "avx512_bf16"} <= cpu_flags()
    for level in ("portable", "avx2", "hvx", "neon"):
        assert native(level) is False, level
    for level in ("avx512", "avx512vnni", "amx"):
        assert native(level) is (htp.simd_supported(level) and bf16_cpu), level
    assert htp.native_bf16_attention() is native(htp.simd_level())
