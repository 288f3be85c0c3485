from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Iterator

import numpy as np
import pytest

import estream_htp as htp
from estream_htp import _core
from estream_htp import testing as T


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


# ---------------------------------------------------------------------- K-quant stress inputs
def kquant_stress_case(
    t: int, n: int, sb: int, seed: int, fmt: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(blocks, tiles, activations)``: Q4_K / Q5_K / Q6_K blocks for W[n][256*sb] (fmt their
    tile format's name), packed, and activations[t][256*sb], chosen to stress the fp32
    epilogue's rounding: fp16 scales with full significands over four decades (subnormal ones
    included; Q6_K's of both signs), the extreme 6-bit scales / mins (63; Q6_K's -128) next to
    random ones, Q4_K / Q5_K ``dmin`` from the same range as ``d`` (the scale and min products
    of a block are often of one size and cancel), activation rows of magnitudes 1e-3..1e3 with
    50x outliers and an all-positive first block (a large activation sum)."""
    rng = np.random.default_rng(seed)
    k = 256 * sb

    def f16(shape, lo, hi):
        v = np.exp(rng.uniform(np.log(lo), np.log(hi), shape))
        return v.astype(np.float16)[..., None].view(np.uint8)

    if fmt == "q6_k-t32r4":
        b = T.random_q6_k_blocks(rng, n, k)
        b[..., 208:210] = f16((n, sb), 1e-7, 1e-3).reshape(n, sb, 2)
        b[..., 209] |= (rng.random((n, sb)) < 0.5).astype(np.uint8) << 7  # negative d
        b[: max(1, n // 4), :, 192:208] = np.uint8(0x80)  # scale -128 everywhere
        return b, T.pack_q6_k_t32r4(b), _stress_activations(rng, t, k)
    gen = T.random_q4_k_blocks if fmt == "q4_k-t32r4" else T.random_q5_k_blocks
    b = gen(rng, n, k)
    b[..., 0:2] = f16((n, sb), 1e-7, 1e-3).reshape(n, sb, 2)
    b[..., 2:4] = f16((n, sb), 1e-7, 1e-3).reshape(n, sb, 2)
    b[: max(1, n // 4), :, 4:16] = np.uint8(0xFF)  # every 6-bit scale and min 63
    pack = T.pack_q4_k_t32r4 if fmt == "q4_k-t32r4" else T.pack_q5_k_t32r4
    return b, pack(b), _stress_activations(rng, t, k)


def _stress_activations(rng: np.random.Generator, t: int, k: int) -> np.ndarray:
    x = rng.standard_normal((t, k)) * np.exp(rng.uniform(np.log(1e-3), np.log(1e3), (t, 1)))
    x[rng.random((t, k)) < 0.01] *= 50.0
    x[:, :32] = np.abs(x[:, :32])  # an all-positive block: the activation sum is large
    return x.astype(np.float32)


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
