"""Build switches of the C library, read from the environment when the package is built.

Kept free of imports from the package so the cffi build script can load it by path.

* ``ESTREAM_HTP_SANITIZE=1`` — build with ``-fsanitize=address,undefined`` (abort on the first
  report); load with ``LD_PRELOAD=$(gcc -print-file-name=libasan.so)``.
* ``ESTREAM_HTP_NO_SIMD=1`` — compile only the portable kernels (no x86 target functions).
* ``ESTREAM_HTP_CFLAGS`` — extra compiler flags, split on whitespace (appended last).
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["BASE_CFLAGS", "compile_flags"]

BASE_CFLAGS = [
    "-O3",
    "-std=gnu11",
    "-pthread",
    "-fno-strict-aliasing",
    "-Wall",
    "-Wno-unused-function",
    "-Werror=implicit-function-declaration",  # a missing prototype is a wrong call, not a warning
]


def _on(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def compile_flags(env: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """Return ``(cflags, ldflags)`` for the given environment."""
    cflags = list(BASE_CFLAGS)
    ldflags = ["-pthread", "-lm"]
    if _on(env.get("ESTREAM_HTP_SANITIZE")):
        san = [
            "-fsanitize=address,undefined",
            "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer",
        ]
        cflags = [f for f in cflags if f != "-O3"] + ["-O1", "-g", *san]
        ldflags += san
    if _on(env.get("ESTREAM_HTP_NO_SIMD")):
        cflags.append("-DHTP_NO_SIMD")
    cflags += (env.get("ESTREAM_HTP_CFLAGS") or "").split()
    return cflags, ldflags
