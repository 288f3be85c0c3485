from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Iterator

import pytest

import estream_htp as htp
from estream_htp import _core


def cpu_flags() -> set[str]:
    """The instruction-set flags /proc/cpuinfo lists (empty where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


_HOST_LEVELS = (
    ("portable", "neon")
    if platform.machine().lower() in ("aarch64", "arm64")
    else ("portable", "avx2", "avx512", "avx512vnni", "amx")
)
# The kernel tables this CPU runs (loops over levels use these) ...
LEVELS = [lvl for lvl in _HOST_LEVELS if htp.simd_supported(lvl)]
# ... and, for parametrize, every table of this architecture: the ones this CPU cannot run show
# up as skips, so a run says which kernels it did not check (test_runtime checks that the
# detection behind them agrees with /proc/cpuinfo, so a skip cannot stand for a detection bug).
SIMD_PARAMS = [
    pytest.param(
        lvl,
        marks=pytest.mark.skipif(
            lvl not in LEVELS, reason=f"this CPU lacks the {lvl} instructions (hardware)"
        ),
    )
    for lvl in _HOST_LEVELS
]


@contextlib.contextmanager
def mode(
    simd: str | None = None, act: str | None = None, threads: int | None = None
) -> Iterator[None]:
    """Temporarily switch SIMD level / activation format / thread count."""
    old = (htp.simd_level(), htp.get_activation_format(), htp.get_num_threads())
    try:
        if simd is not None:
            _core._set_simd_level(simd)
        if act is not None:
            htp.set_activation_format(act)  # type: ignore[arg-type]
        if threads is not None:
            htp.set_num_threads(threads)
        yield
    finally:
        _core._set_simd_level(old[0])
        htp.set_activation_format(old[1])  # type: ignore[arg-type]
        htp.set_num_threads(old[2])


# ---------------------------------------------------------------------- the hexagon backend
def hexagon_missing() -> list[str]:
    """Tools missing to run the hexagon backend here (empty: it can run)."""
    from estream_htp import _hexagon

    return _hexagon.missing_tools()


_HX_MISSING = hexagon_missing()
# Where the toolchain is required (nox installs it as root: CI), a missing tool fails the tests
# instead of skipping them.
_HX_REQUIRED = os.environ.get("ESTREAM_HTP_REQUIRE_HEXAGON", "").strip() == "1"
needs_hexagon = pytest.mark.skipif(
    bool(_HX_MISSING) and not _HX_REQUIRED,
    reason="hexagon backend: " + ", ".join(_HX_MISSING) + " not installed "
    "(apt-get install clang-19 lld-19 qemu-user-static)",
)
# every backend kind, the hexagon one skipped (with the reason) where its tools are missing
KINDS = ["host", "host-process", pytest.param("hexagon", marks=needs_hexagon)]
REMOTE_KINDS = ["host-process", pytest.param("hexagon", marks=needs_hexagon)]
