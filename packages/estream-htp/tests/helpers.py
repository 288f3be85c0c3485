from __future__ import annotations

import contextlib
from collections.abc import Iterator

import estream_htp as htp
from estream_htp import _core

LEVELS = [
    lvl for lvl in ("portable", "avx2", "avx512", "avx512vnni", "neon") if htp.simd_supported(lvl)
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
